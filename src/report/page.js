// Thumbnails past the first few get their src as they come near the screen (or into a
// scrolled lineage row): Chromium ignores loading="lazy" on file: pages.
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

// Pages of items for large runs. Items not on the shown page are taken out of the document,
// not hidden: Chromium loads lazy images under display:none at once, which would load every
// thumbnail of the run. Without script every item shows and native lazy loading still keeps
// off-screen thumbnails unloaded.
(function () {
  var items = [].slice.call(document.querySelectorAll("section.item"));
  var per = Number(document.body.getAttribute("data-per-page")) || 100;
  var nav = document.getElementById("pages");
  if (!nav || items.length <= per) return;
  var holder = items[0].parentNode;
  var end = document.createComment("end of items");
  holder.insertBefore(end, items[items.length - 1].nextSibling);
  var pages = Math.ceil(items.length / per);
  var buttons = [];
  function show(p) {
    items.forEach(function (s) { if (s.parentNode) s.parentNode.removeChild(s); });
    var from = p < 0 ? 0 : p * per, to = p < 0 ? items.length : (p + 1) * per;
    items.slice(from, to).forEach(function (s) { holder.insertBefore(s, end); });
    buttons.forEach(function (b, i) { b.className = i === (p < 0 ? pages : p) ? "on" : ""; });
  }
  function button(text, p) {
    var b = document.createElement("button");
    b.type = "button";
    b.textContent = text;
    b.onclick = function () { show(p); nav.scrollIntoView(); };
    nav.appendChild(b);
    buttons.push(b);
  }
  for (var p = 0; p < pages; p++) {
    button((p * per + 1) + "\u2013" + Math.min(items.length, (p + 1) * per), p);
  }
  button("all " + items.length, -1);
  function follow() {
    var id = decodeURIComponent(location.hash.slice(1));
    var at = -1;
    if (id) {
      var sel = "#" + CSS.escape(id);
      items.some(function (s, i) {
        if (s.id === id || s.querySelector(sel)) { at = i; return true; }
        return false;
      });
    }
    show(at < 0 ? 0 : Math.floor(at / per));
    var target = id && document.getElementById(id);
    if (target) target.scrollIntoView();
  }
  window.addEventListener("hashchange", follow);
  follow();
})();
