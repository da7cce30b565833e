// Pages of items for large runs; without script every item shows, and native lazy loading
// still keeps off-screen thumbnails unloaded.
(function () {
  var items = [].slice.call(document.querySelectorAll("section.item"));
  var per = Number(document.body.getAttribute("data-per-page")) || 100;
  var nav = document.getElementById("pages");
  if (!nav || items.length <= per) return;
  var pages = Math.ceil(items.length / per);
  var buttons = [];
  function show(p) {
    items.forEach(function (s, i) { s.hidden = Math.floor(i / per) !== p; });
    buttons.forEach(function (b, i) { b.className = i === p ? "on" : ""; });
  }
  for (var p = 0; p < pages; p++) {
    var b = document.createElement("button");
    b.type = "button";
    b.textContent = (p * per + 1) + "\u2013" + Math.min(items.length, (p + 1) * per);
    b.onclick = (function (p) { return function () { show(p); nav.scrollIntoView(); }; })(p);
    nav.appendChild(b);
    buttons.push(b);
  }
  function follow() {
    var id = decodeURIComponent(location.hash.slice(1));
    var target = id && document.getElementById(id);
    var section = target && target.closest("section.item");
    var i = items.indexOf(section);
    show(i < 0 ? 0 : Math.floor(i / per));
    if (section) target.scrollIntoView();
  }
  window.addEventListener("hashchange", follow);
  follow();
})();
