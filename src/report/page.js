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
