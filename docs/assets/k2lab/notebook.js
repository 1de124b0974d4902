// Notebook pages of the k2lab site (scripts/site/notebook_page.py writes them): draws each stored plotly figure with
// the plotly.js bundled into the site (no CDN). A figure inside a closed fold (a solution) is drawn when the fold
// opens, so it gets its real width. (The Mermaid diagrams are committed SVG pictures: scripts/site/diagrams.py.)
(function () {
  "use strict";

  function drawPlot(div) {
    if (div.dataset.k2Drawn || div.offsetParent === null) return; // drawn already, or hidden in a closed fold
    var spec = JSON.parse(div.nextElementSibling.textContent);
    var layout = spec.layout || {};
    var config = Object.assign({ responsive: true, displaylogo: false }, spec.config || {});
    div.dataset.k2Drawn = "pending";
    window.Plotly.newPlot(div, spec.data || [], layout, config).then(
      function () { div.dataset.k2Drawn = "yes"; },
      function (err) { div.dataset.k2Drawn = "failed"; console.error("k2lab: a figure failed to draw", err); }
    );
  }

  function drawAll(root) {
    if (window.Plotly) root.querySelectorAll(".k2-plotly").forEach(drawPlot);
  }

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", function () { drawAll(document); });
  } else {
    drawAll(document);
  }
  // A fold opened: draw what it hides.
  document.addEventListener("toggle", function (event) {
    if (event.target.open) drawAll(event.target);
  }, true);
})();
