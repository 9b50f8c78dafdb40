// kvbench report: click a table header to sort by that column (numbers by their raw value).
(function () {
  "use strict";
  function key(cell) {
    var raw = cell.getAttribute("data-sort");
    if (raw !== null && raw !== "") { var n = parseFloat(raw); if (!isNaN(n)) { return n; } }
    return cell.textContent.trim().toLowerCase();
  }
  function compare(a, b) {
    if (typeof a === "number" && typeof b === "number") { return a - b; }
    if (typeof a === "number") { return -1; }
    if (typeof b === "number") { return 1; }
    return a < b ? -1 : a > b ? 1 : 0;
  }
  document.querySelectorAll("table.sortable").forEach(function (table) {
    var heads = table.querySelectorAll("thead th");
    heads.forEach(function (th, col) {
      th.classList.add("sortable");
      th.addEventListener("click", function () {
        var asc = !th.classList.contains("asc");
        heads.forEach(function (h) { h.classList.remove("asc", "desc"); });
        th.classList.add(asc ? "asc" : "desc");
        var body = table.tBodies[0];
        var rows = Array.prototype.slice.call(body.rows);
        rows.sort(function (r1, r2) {
          var c = compare(key(r1.cells[col]), key(r2.cells[col]));
          return asc ? c : -c;
        });
        rows.forEach(function (r) { body.appendChild(r); });
      });
    });
  });
})();
// a link to a collapsed section (the navigation, the evidence of a recommendation) opens it
(function () {
  "use strict";
  function openTarget() {
    var el = location.hash ? document.getElementById(location.hash.slice(1)) : null;
    for (; el; el = el.parentElement) {
      if (el.tagName === "DETAILS") { el.open = true; }
      var inner = el.querySelector && el.querySelector(":scope > details");
      if (inner) { inner.open = true; }
    }
  }
  window.addEventListener("hashchange", openTarget);
  openTarget();
})();
