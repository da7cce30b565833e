// The desk's run page: the items a page at a time from the JSON API (filtered by the
// database), followed live, culled by keyboard. Everything from the record is put in the page
// as text (textContent, attributes), never as markup.
//
// The picks: each output (or a task's placeholder) is an element `.out` with `data-task`, the
// task's name as `imgpipe reroll` takes it. `p` picks it, `x` rejects it (picked too, marked
// rejected); each change dispatches `desk:picks` with `{tasks: [...]}`. A `desk:set-picks`
// event with `{tasks: [...]}` replaces them (after a reroll is confirmed, say). Picks are kept
// in sessionStorage under the run's id: they survive paging, filtering and live refreshes.
// A pick may also name a whole item (`mug`: `i`, or the item's button) or one step for every
// item (`*/clean`: the step's button above the items), as `imgpipe reroll` takes them: the
// page never lists the items such a pick covers, the reroll's dry run prices them.
(function () {
  "use strict";
  var body = document.body;
  var run = body.getAttribute("data-run");
  if (!run) { return; }
  var api = "/api/runs/" + encodeURIComponent(run);
  var list = document.getElementById("list");
  var more = document.getElementById("more");
  var shown = document.getElementById("shown");
  var live = document.getElementById("live");
  var form = document.getElementById("filters");
  var viewer = document.getElementById("viewer");
  var help = document.getElementById("help");

  var tasks = {};       // task name -> its JSON, as last read
  var drawn = {};       // item id -> the JSON it was drawn from
  var next = null;      // the next page's cursor
  var since = null;     // the stamp to ask changes since
  var loading = false;
  var generation = 0;   // bumps when the filter changes: answers to older asks are dropped
  var focus = -1;       // index among the `.out` elements
  var picks = load_picks();

  function load_picks() {
    try {
      var kept = JSON.parse(sessionStorage.getItem("desk-picks:" + run) || "{}");
      return kept && typeof kept === "object" ? kept : {};
    } catch (e) { return {}; }
  }

  function save_picks() {
    try { sessionStorage.setItem("desk-picks:" + run, JSON.stringify(picks)); } catch (e) { /* kept in the page */ }
  }

  function picks_changed() {
    save_picks();
    mark_all();
    document.dispatchEvent(new CustomEvent("desk:picks", { detail: { tasks: Object.keys(picks) } }));
  }

  document.addEventListener("desk:set-picks", function (e) {
    picks = {};
    ((e.detail && e.detail.tasks) || []).forEach(function (t) { picks[t] = "pick"; });
    picks_changed();
  });

  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) { e.className = cls; }
    if (text !== undefined && text !== null) { e.textContent = String(text); }
    return e;
  }

  function query() {
    var q = new URLSearchParams();
    new FormData(form).forEach(function (v, k) { if (v !== "") { q.set(k, v); } });
    return q;
  }

  // One output (or the task's placeholder when it has none): its picture and caption.
  function out(task, o) {
    var fig = el("figure", "out st-" + task.status);
    fig.setAttribute("data-task", task.task);
    fig.setAttribute("data-item", task.item);
    fig.setAttribute("data-step", task.step);
    fig.setAttribute("tabindex", "-1");
    var pic;
    if (o && o.src) {
      pic = el("a", "thumb");
      pic.href = o.src;
      pic.target = "_blank";
      var img = el("img");
      img.loading = "lazy";
      img.decoding = "async";
      // The grid shows the thumbnail; the full image opens on click or in the compare view.
      img.src = o.thumb || o.src;
      img.alt = task.item + "/" + task.step + "[" + o.index + "]";
      pic.appendChild(img);
      fig.setAttribute("data-src", o.src);
    } else {
      pic = el("div", "thumb none");
      pic.appendChild(el("span", "badge b-" + task.status, task.status));
      var why = o ? (o.download_error || "its file is on its way, or not kept here") : (task.error || "no image");
      pic.appendChild(el("span", "why", why));
    }
    fig.appendChild(pic);
    var cap = el("figcaption");
    cap.appendChild(el("span", "mark"));
    cap.appendChild(el("b", null, task.step + "[" + (o ? o.index : task.index) + "]"));
    cap.appendChild(document.createTextNode(" · " + task.operation + " · " + task.credits_billed + " cr"));
    if (task.possibly_billed > 0) { cap.appendChild(el("span", "risk", " · possibly billed")); }
    if (task.earlier.length > 0) { cap.appendChild(el("span", "note", " · " + task.earlier.length + " earlier")); }
    // What a check said when it failed the image or could not judge it: the reason a person looks.
    ((o && o.checks) || []).forEach(function (v) {
      if (v.verdict === "passed") { return; }
      var c = el("div", "check");
      c.appendChild(el("span", "badge b-" + (v.verdict === "not_checked" ? "pending" : "failed"),
        v.verdict === "not_checked" ? "not checked" : (v.acted === "flagged" ? "flagged" : "check failed")));
      c.appendChild(el("span", "why", " " + v.check + ": " + v.reason));
      cap.appendChild(c);
    });
    if (task.request.length > 0) {
      var dl = el("dl", "req");
      task.request.forEach(function (f) {
        var d = el("div");
        d.appendChild(el("dt", null, f.name));
        var dd = el("dd", null, f.value);
        dd.title = f.value;
        d.appendChild(dd);
        dl.appendChild(d);
      });
      cap.appendChild(dl);
    }
    fig.appendChild(cap);
    return fig;
  }

  function item_element(item) {
    var sec = el("section", "item");
    sec.setAttribute("data-item", item.item);
    var h = el("h3", null, item.item);
    var billed = 0;
    item.tasks.forEach(function (t) { billed += t.credits_billed; });
    h.appendChild(el("span", "badge", billed + " cr"));
    var whole = el("button", "pick-item", "pick the item");
    whole.type = "button";
    whole.setAttribute("data-item", item.item);
    whole.addEventListener("click", function () { toggle_name(item.item, "pick"); });
    h.appendChild(whole);
    sec.appendChild(h);
    var row = el("div", "outs");
    item.tasks.forEach(function (t) {
      tasks[t.task] = t;
      if (t.outputs.length === 0) { row.appendChild(out(t, null)); }
      t.outputs.forEach(function (o) { row.appendChild(out(t, o)); });
    });
    sec.appendChild(row);
    return sec;
  }

  // How an output is picked: itself, through its item, or through its step for every item.
  function picked_as(fig) {
    return picks[fig.getAttribute("data-task")] || picks[fig.getAttribute("data-item")] ||
      picks["*/" + fig.getAttribute("data-step")];
  }

  function mark(fig) {
    var how = picked_as(fig);
    fig.classList.toggle("picked", how === "pick");
    fig.classList.toggle("rejected", how === "reject");
    var m = fig.querySelector(".mark");
    if (m) { m.textContent = how === "reject" ? "rejected " : how === "pick" ? "picked " : ""; }
  }

  function mark_item(sec) {
    var whole = picks[sec.getAttribute("data-item")] === "pick";
    sec.classList.toggle("picked", whole);
    var b = sec.querySelector("button.pick-item");
    if (b) { b.setAttribute("aria-pressed", String(whole)); }
  }

  function mark_all() {
    [].forEach.call(list.querySelectorAll(".out"), mark);
    [].forEach.call(list.querySelectorAll(".item"), mark_item);
    [].forEach.call(document.querySelectorAll("button.pick-step"), function (b) {
      b.setAttribute("aria-pressed", String(picks["*/" + b.getAttribute("data-step")] === "pick"));
    });
  }

  // Picks (again: unpicks) `name`, an output's task, an item or `*/step`.
  function toggle_name(name, how) {
    if (picks[name] === how) { delete picks[name]; } else { picks[name] = how; }
    picks_changed();
  }

  function outs() { return list.querySelectorAll(".out"); }

  function set_focus(i) {
    var all = outs();
    if (all.length === 0) { focus = -1; return; }
    i = Math.max(0, Math.min(i, all.length - 1));
    var old = list.querySelector(".out.focus");
    if (old) { old.classList.remove("focus"); }
    focus = i;
    all[i].classList.add("focus");
    all[i].focus({ preventScroll: true });
    all[i].scrollIntoView({ block: "nearest" });
    if (i >= all.length - 3 && next !== null) { page(); }
  }

  function focused() {
    var f = list.querySelector(".out.focus");
    return f;
  }

  // Places an item's element among those shown, in the order of item ids; an item drawn
  // from the same record already is left as it is (its images not fetched again).
  function place(item) {
    var text = JSON.stringify(item);
    if (drawn[item.item] === text && list.querySelector('.item[data-item="' + CSS.escape(item.item) + '"]')) { return; }
    drawn[item.item] = text;
    var fresh = item_element(item);
    var same = list.querySelector('.item[data-item="' + CSS.escape(item.item) + '"]');
    if (same) {
      var had = same.querySelector(".out.focus");
      var task = had && had.getAttribute("data-task");
      list.replaceChild(fresh, same);
      if (task) {
        var again = fresh.querySelector('.out[data-task="' + CSS.escape(task) + '"]');
        if (again) { again.classList.add("focus"); }
      }
    } else {
      var after = null;
      [].some.call(list.children, function (s) {
        if (s.getAttribute("data-item") > item.item) { after = s; return true; }
        return false;
      });
      list.insertBefore(fresh, after);
    }
    [].forEach.call(fresh.querySelectorAll(".out"), mark);
    mark_item(fresh);
  }

  function refocus() {
    var f = focused();
    focus = f ? [].indexOf.call(outs(), f) : -1;
  }

  function say_shown() {
    shown.textContent = list.children.length + " item(s) shown" + (next !== null ? ", more below" : "");
  }

  function page() {
    if (loading) { return; }
    loading = true;
    var mine = generation;
    var read = false;
    var q = query();
    if (next !== null) { q.set("after", next); }
    fetch(api + "/items?" + q.toString(), { credentials: "same-origin" })
      .then(function (r) { return r.json().then(function (j) { return { ok: r.ok, j: j }; }); })
      .then(function (a) {
        if (mine !== generation) { return; }
        if (!a.ok) { shown.textContent = a.j.error || "the items could not be read"; return; }
        if (since === null) {
          since = a.j.since;
          document.dispatchEvent(new CustomEvent("desk:picks", { detail: { tasks: Object.keys(picks) } }));
        }
        a.j.items.forEach(place);
        next = a.j.next;
        more.hidden = next === null;
        refocus();
        say_shown();
        read = true;
      })
      .catch(function (e) { shown.textContent = "the items could not be read: " + e; })
      .then(function () {
        if (mine !== generation) { return; }
        loading = false;
        // A filter's page looks at part of the run: a short one that leaves the button in
        // view (where the observer, already told, says nothing more) asks for the next.
        if (read && next !== null && more.getBoundingClientRect().top < window.innerHeight + 600) { page(); }
      });
  }

  function restart() {
    generation += 1;
    loading = false;
    next = null;
    since = null;
    focus = -1;
    while (list.firstChild) { list.removeChild(list.firstChild); }
    drawn = {};
    page();
  }

  var typing = null;
  form.addEventListener("input", function () {
    clearTimeout(typing);
    typing = setTimeout(restart, 250);
  });
  form.addEventListener("submit", function (e) { e.preventDefault(); restart(); });
  [].forEach.call(document.querySelectorAll("button.show"), function (b) {
    b.addEventListener("click", function () {
      var box = form.elements[b.getAttribute("data-filter")];
      if (box) { box.checked = !box.checked; restart(); }
    });
  });
  more.addEventListener("click", page);
  if ("IntersectionObserver" in window) {
    new IntersectionObserver(function (es) {
      if (es.some(function (e) { return e.isIntersecting; }) && next !== null) { page(); }
    }, { rootMargin: "600px" }).observe(more);
  }

  list.addEventListener("click", function (e) {
    var fig = e.target.closest(".out");
    if (fig) { set_focus([].indexOf.call(outs(), fig)); }
  });

  // The run's header and costs: a fragment the report's templates made (escaping what they
  // show), summed over the whole run, so asked again only every ten seconds while it changes.
  var head = document.getElementById("head");
  var head_at = 0;
  function load_head() {
    head_at = Date.now();
    fetch("/runs/" + encodeURIComponent(run) + "/head", { credentials: "same-origin" })
      .then(function (r) { return r.ok ? r.text() : null; })
      .then(function (html) { if (html !== null) { head.innerHTML = html; } })
      .catch(function () { /* the next change asks again */ });
  }
  load_head();

  // Follows the run: what changed since the last look, every second.
  function poll() {
    if (since === null) { return; }
    var mine = generation;
    var q = query();
    q.set("since", since);
    fetch(api + "/changes?" + q.toString(), { credentials: "same-origin" })
      .then(function (r) { return r.ok ? r.json() : null; })
      .then(function (j) {
        if (!j || mine !== generation) { return; }
        since = j.since;
        j.items.forEach(function (item) {
          var there = list.querySelector('.item[data-item="' + CSS.escape(item.item) + '"]');
          // An item past the cursor (the last item looked at, shown or not) comes with its
          // page, when that is read.
          if (there || next === null || item.item <= next) { place(item); }
        });
        refocus();
        say_shown();
        if (j.items.length > 0 && Date.now() - head_at > 10000) { load_head(); }
        var badge = document.getElementById("run-status");
        if (badge && badge.textContent !== j.status) {
          badge.textContent = j.status;
          badge.className = "badge b-" + j.status;
        }
        live.textContent = "following the run · " + new Date().toLocaleTimeString();
      })
      .catch(function () { live.textContent = "the desk does not answer"; });
  }
  setInterval(poll, 1000);

  function toggle(how) {
    var f = focused();
    if (f) { toggle_name(f.getAttribute("data-task"), how); }
  }

  // The focused output's whole item.
  function toggle_item() {
    var f = focused();
    if (f) { toggle_name(f.getAttribute("data-item"), "pick"); }
  }

  [].forEach.call(document.querySelectorAll("button.pick-step"), function (b) {
    b.addEventListener("click", function () { toggle_name("*/" + b.getAttribute("data-step"), "pick"); });
  });
  mark_all();

  function close() {
    viewer.hidden = true;
    help.hidden = true;
    while (viewer.firstChild) { viewer.removeChild(viewer.firstChild); }
  }

  function picture(src, label, note) {
    var fig = el("figure", "full");
    if (src) {
      var img = el("img");
      img.src = src;
      img.alt = label;
      fig.appendChild(img);
    } else {
      fig.appendChild(el("div", "thumb none", "file not kept here"));
    }
    fig.appendChild(el("figcaption", null, label + (note ? " · " + note : "")));
    return fig;
  }

  function open_full() {
    var f = focused();
    if (!f || !f.getAttribute("data-src")) { return; }
    close();
    viewer.appendChild(picture(f.getAttribute("data-src"), f.getAttribute("data-task"), "Esc closes"));
    viewer.hidden = false;
  }

  // The focused output beside its earlier versions, oldest first.
  function compare() {
    var f = focused();
    if (!f) { return; }
    var t = tasks[f.getAttribute("data-task")];
    if (!t) { return; }
    close();
    var row = el("div", "compare");
    var src = f.getAttribute("data-src");
    var k = 0;
    t.outputs.forEach(function (o) { if (o.src === src) { k = o.k; } });
    var earlier = t.earlier.filter(function (e) { return e.k === k; });
    if (earlier.length === 0) { row.appendChild(el("p", null, "No earlier version of " + t.task + ".")); }
    earlier.forEach(function (e) {
      row.appendChild(picture(e.src, "earlier " + t.task, e.reason + " · " + new Date(e.superseded_at).toLocaleString()));
    });
    row.appendChild(picture(src, "now " + t.task, t.status));
    viewer.appendChild(row);
    viewer.hidden = false;
  }

  document.getElementById("help-open").addEventListener("click", function () { help.hidden = !help.hidden; });
  viewer.addEventListener("click", close);

  document.addEventListener("keydown", function (e) {
    var t = e.target;
    if (e.ctrlKey || e.metaKey || e.altKey) { return; }
    if (t && (t.tagName === "INPUT" || t.tagName === "SELECT" || t.tagName === "TEXTAREA")) {
      if (e.key === "Escape") { t.blur(); }
      return;
    }
    var keys = {
      j: function () { set_focus(focus + 1); },
      ArrowDown: function () { set_focus(focus + 1); },
      k: function () { set_focus(focus - 1); },
      ArrowUp: function () { set_focus(focus - 1); },
      p: function () { toggle("pick"); },
      x: function () { toggle("reject"); },
      i: toggle_item,
      o: open_full,
      c: compare,
      "?": function () { help.hidden = !help.hidden; },
      Escape: close
    };
    var act = keys[e.key];
    if (act) { e.preventDefault(); act(); }
  });

  page();
})();
