// Thumbnails past the first few get their src as they come near the screen (or into a
// scrolled lineage row, or an opened list of earlier versions): Chromium ignores
// loading="lazy" on file: pages.
(function () {
  var lazy = [].slice.call(document.querySelectorAll("img[data-src]"));
  function load(img) {
    if (img.getAttribute("data-src")) {
      img.src = img.getAttribute("data-src");
      img.removeAttribute("data-src");
    }
  }
  if (!("IntersectionObserver" in window)) { lazy.forEach(load); return; }
  var near = new IntersectionObserver(function (entries) {
    entries.forEach(function (e) {
      if (e.isIntersecting) { load(e.target); near.unobserve(e.target); }
    });
  }, { rootMargin: "1200px" });
  lazy.forEach(function (img) { near.observe(img); });
})();

// The reroll command: each ticked box names a task (item/step[index]) or a whole item; the
// command lists them in the order ticked, each once, and leaves out the tasks of an item that
// is itself ticked. The choice is kept in sessionStorage under the run's id, so ticks on the
// run's other pages (in the same tab) add up; where storage is refused it lives in this page.
(function () {
  var bar = document.getElementById("reroll");
  if (!bar) { return; }
  var box = document.getElementById("reroll-command");
  var said = document.getElementById("reroll-said");
  var boxes = [].slice.call(document.querySelectorAll("input.pick"));
  var key = "imgpipe-reroll:" + bar.getAttribute("data-run");
  var chosen = [];
  try { chosen = JSON.parse(sessionStorage.getItem(key) || "[]"); } catch (e) { chosen = []; }
  if (!Array.isArray(chosen)) { chosen = []; }
  // As crate::shell::quote: plain words as they are, anything else single-quoted.
  function quote(w) {
    return /^[A-Za-z0-9\-_.\/:=@%+,]+$/.test(w) ? w : "'" + w.replace(/'/g, "'\\''") + "'";
  }
  function keep() {
    try { sessionStorage.setItem(key, JSON.stringify(chosen)); } catch (e) { /* this page only */ }
  }
  function show() {
    var items = {};
    chosen.forEach(function (c) { if (c.indexOf("/") < 0) { items[c] = true; } });
    var words = chosen.filter(function (c) {
      var slash = c.indexOf("/");
      return slash < 0 || !items[c.slice(0, slash)];
    });
    box.value = words.length ? bar.getAttribute("data-command") + " " +
      words.map(quote).join(" ") + bar.getAttribute("data-flags") : "";
    said.textContent = words.length ? "" : "Tick the outputs to make again: the command appears here.";
    boxes.forEach(function (b) { b.checked = chosen.indexOf(b.value) >= 0; });
  }
  boxes.forEach(function (b) {
    b.addEventListener("change", function () {
      var at = chosen.indexOf(b.value);
      if (b.checked && at < 0) { chosen.push(b.value); }
      if (!b.checked && at >= 0) { chosen.splice(at, 1); }
      keep();
      show();
    });
  });
  document.getElementById("reroll-clear").addEventListener("click", function () {
    chosen = [];
    keep();
    show();
  });
  document.getElementById("reroll-copy").addEventListener("click", function () {
    if (!box.value) { return; }
    function fallback() {
      box.focus();
      box.select();
      var done = false;
      try { done = document.execCommand("copy"); } catch (e) { done = false; }
      said.textContent = done ? "Copied." : "Selected: copy it with Ctrl+C or ⌘C.";
    }
    if (navigator.clipboard && navigator.clipboard.writeText) {
      navigator.clipboard.writeText(box.value).then(function () {
        said.textContent = "Copied.";
      }, fallback);
    } else {
      fallback();
    }
  });
  bar.hidden = false;
  show();
})();
