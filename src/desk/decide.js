// The desk's decisions with their price (served as /assets/decide.js; see
// docs/guides/review-loop.md). It fills the run page's <aside id="decide">:
// - the outputs picked on the page (the `desk:picks` event) priced as
//   `imgpipe reroll RUN TASK... --dry-run` prices them, with what the budget, the balance and
//   each cap have left, and a "Confirm (N credits)" button that pays exactly N;
// - for a stopped run (a sample, or --until), the price of the rest and a
//   "Continue (N credits)" button: the approval gate.
// A price that changed is shown again and asked again (409); a refusal is shown with its hint;
// while the work goes, its progress is shown from GET /api/runs/{run}.
// Everything shown is text (no HTML is built from answers), and the token for the POSTs comes
// from the page's <meta name="imgpipe-desk-token"> (the cookie is HttpOnly).
'use strict';
(() => {
  const aside = document.getElementById('decide');
  if (!aside) return;
  const meta = document.querySelector('meta[name="imgpipe-desk-token"]');
  const token = meta ? meta.content : '';
  const run = aside.dataset.run ||
    decodeURIComponent((location.pathname.match(/^\/runs\/([^/]+)/) || [])[1] || '');
  if (!run) return;
  const api = '/api/runs/' + encodeURIComponent(run);
  const POLL_MS = 1000;
  // The parts whose work is going: their progress is not replaced.
  const busy = new Set();

  const el = (tag, attrs, ...children) => {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === 'class') node.className = v;
      else if (k === 'on') for (const [e, f] of Object.entries(v)) node.addEventListener(e, f);
      else node.setAttribute(k, v);
    }
    node.append(...present(children));
    return node;
  };
  // What is there of `nodes` (a part left out is null).
  const present = nodes => nodes.filter(c => c !== null && c !== undefined);
  const show = (part, ...nodes) => part.replaceChildren(...present(nodes));

  // Two parts: the reroll of the picked outputs, and the gate of a stopped run.
  const reroll = el('section', { id: 'decide-reroll', 'aria-live': 'polite' });
  const gate = el('section', { id: 'decide-gate', 'aria-live': 'polite' });
  aside.replaceChildren(reroll, gate);

  const post = async (path, body) => {
    try {
      const r = await fetch(api + path, {
        method: 'POST',
        credentials: 'same-origin',
        headers: { 'Content-Type': 'application/json', Authorization: 'Bearer ' + token },
        body: JSON.stringify(body),
      });
      let json = {};
      try { json = await r.json(); } catch (_) { /* an empty body */ }
      return { status: r.status, body: json || {} };
    } catch (e) {
      return { status: 0, body: { error: 'the desk did not answer: ' + e.message,
        hint: 'is `imgpipe review` still running? start it again for a new URL' } };
    }
  };

  const get = async path => {
    const r = await fetch(api + path, { credentials: 'same-origin' });
    return r.ok ? r.json() : null;
  };

  // An error as the command line says it: the message, and its hint below.
  const refusal = body => el('div', { class: 'refused', role: 'alert' },
    el('p', { class: 'error' }, body.error || 'refused'),
    body.hint ? el('p', { class: 'hint' }, 'hint: ' + body.hint) : null);

  // What the budget, the balance and each cap have left, beside the price.
  const left = priced => {
    const rows = [];
    const row = (what, value) => rows.push(el('tr', {},
      el('th', {}, what), el('td', { class: 'n' }, value === null || value === undefined ? 'unknown' : String(value))));
    row('budget left', priced.budget_left === null ? 'no budget' : priced.budget_left);
    row('balance', priced.balance);
    for (const c of priced.caps || []) {
      row('cap ' + c.name + ' left (' + c.per + ')', c.left + ' of ' + c.credits);
    }
    return el('table', { class: 'left' }, el('tbody', {}, ...rows));
  };

  const taskName = t => t.item + '/' + t.step + '[' + t.index + ']';

  // One decision: `part` shows it; `path` is /reroll or /continue; `body` what it asks.
  const decide = async (part, path, body, label, what) => {
    part.replaceChildren(el('p', { class: 'pricing' }, 'pricing ' + what + '…'));
    const priced = await post(path, Object.assign({ dry_run: true }, body));
    if (priced.status !== 200) {
      part.replaceChildren(refusal(priced.body));
      return;
    }
    offer(part, path, body, label, what, priced.body, null);
  };

  const offer = (part, path, body, label, what, priced, said) => {
    const credits = priced.credits;
    const tasks = (priced.tasks || []).map(t =>
      el('li', { 'data-task': taskName(t) }, taskName(t) + ' — ' + t.reason + ', ' + t.credits + ' credits'));
    const button = el('button', { type: 'button', class: 'confirm', 'data-credits': String(credits) },
      label + ' (' + credits + ' credits)');
    if (priced.fits === false || tasks.length === 0) button.disabled = true;
    button.addEventListener('click', () => confirm(part, path, body, label, what, credits, priced.revision));
    show(part,
      said,
      el('h2', {}, what),
      el('p', { class: 'price' }, el('span', { class: 'credits' }, String(credits)), ' credits'),
      el('ul', { class: 'tasks' }, ...tasks),
      left(priced),
      priced.fits === false ? refusal(split(priced.refused)) : null,
      button);
  };

  const split = text => {
    const [error, hint] = String(text || '').split('\nhint: ');
    return { error, hint };
  };

  // A confirm carries the price and the revision it was shown: the desk pays for that, once,
  // or answers 409 with what it would pay now.
  const confirm = async (part, path, body, label, what, credits, revision) => {
    for (const b of part.querySelectorAll('button')) b.disabled = true;
    const answer = await post(path, Object.assign({ credits, revision }, body));
    if (answer.status === 202) {
      // What was picked is being paid for: the picks start again from none.
      if (path === '/reroll') document.dispatchEvent(new CustomEvent('desk:set-picks', { detail: { tasks: [] } }));
      follow(part, what, credits);
      return;
    }
    if (answer.status === 409 && typeof answer.body.credits === 'number') {
      // The price changed since it was shown: nothing was spent; show it and ask again.
      const again = await post(path, Object.assign({ dry_run: true }, body));
      if (again.status === 200) {
        offer(part, path, body, label, what, again.body,
          el('p', { class: 'stale', role: 'alert' }, answer.body.error));
        return;
      }
    }
    part.replaceChildren(refusal(answer.body));
  };

  // The work goes beside the server: its progress from the run's record, its end from the
  // desk's record of it. The run page's live refresh shows the new images.
  const follow = (part, what, credits) => {
    busy.add(part);
    const progress = el('p', { class: 'progress' }, what + ': started, ' + credits + ' credits confirmed');
    part.replaceChildren(progress);
    const tick = async () => {
      const [status, work] = await Promise.all([get(''), get('/work')]);
      if (status) {
        const t = status.totals || {};
        progress.textContent = what + ': run ' + status.status + ', ' + (t.succeeded || 0) +
          ' of ' + (t.tasks || 0) + ' tasks succeeded, ' + (t.billed_credits || 0) + ' credits billed';
      }
      if (work && work.state === 'going') {
        setTimeout(tick, POLL_MS);
        return;
      }
      busy.delete(part);
      if (work && work.state === 'failed') {
        part.replaceChildren(progress, refusal(work));
      } else {
        part.replaceChildren(progress, el('p', { class: 'done' }, what + ': done'));
      }
      document.dispatchEvent(new CustomEvent('desk:changed', { detail: { run } }));
      checkGate();
    };
    setTimeout(tick, POLL_MS);
  };

  // The approval gate: a stopped run shows the price of the rest.
  const checkGate = async () => {
    const status = await get('');
    if (!status || status.status !== 'stopped') {
      // An offer for the rest no longer stands; what the last continuation did stays shown.
      if (gate.querySelector('button.confirm')) gate.replaceChildren();
      return;
    }
    decide(gate, '/continue', {}, 'Continue', 'the rest of run ' + run);
  };

  document.addEventListener('desk:picks', e => {
    // While a reroll goes, its progress stays; picks made meanwhile are priced after.
    if (busy.has(reroll)) return;
    const tasks = (e.detail && e.detail.tasks) || [];
    if (tasks.length === 0) {
      reroll.replaceChildren();
      return;
    }
    decide(reroll, '/reroll', { tasks }, 'Confirm', 'reroll of ' + tasks.length + ' pick(s)');
  });
  checkGate();
})();
