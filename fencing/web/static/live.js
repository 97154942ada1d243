// fencing dashboard: live updates by server-sent events. No framework, no build step.
// One event stream per page; the server reads the table once per interval for all of them.
(function () {
  "use strict";
  var body = document.body;
  var root = body.getAttribute("data-root") || "";
  var status = document.getElementById("live");
  var offset = 0; // the database's clock minus this browser's, in seconds
  var refreshing = false;

  function dbNow() { return Date.now() / 1000 + offset; }

  // Each reading of the database's clock was taken before it arrived here, so dbClock minus
  // the arrival is a lower bound of the offset, short by the reading's age: keep the largest
  // (the freshest). A snapshot the feed read up to an interval before sending would otherwise
  // set every countdown back by its age. A bound far below (5 s) is a clock that moved: take it.
  var known = false;
  function setOffset(dbClock) {
    if (typeof dbClock !== "number") { return; }
    var bound = dbClock - Date.now() / 1000;
    if (!known || bound > offset || offset - bound > 5) { offset = bound; }
    known = true;
  }

  // durations as the command line writes them (fencing._format.duration: change both together):
  // 3.2s, 42s, 5m 02s, 2h 05m, 3d 04h, rounded down so a time left is never shown longer
  function two(n) { return (n < 10 ? "0" : "") + n; }
  function duration(value) {
    if (value === null || value === undefined) { return "—"; }
    var s = Math.max(value, 0);
    if (s < 10) { return (Math.floor(s * 10) / 10).toFixed(1) + "s"; }
    var whole = Math.floor(s);
    if (whole < 60) { return whole + "s"; }
    if (whole < 3600) { return Math.floor(whole / 60) + "m " + two(whole % 60) + "s"; }
    if (whole < 86400) { return Math.floor(whole / 3600) + "h " + two(Math.floor((whole % 3600) / 60)) + "m"; }
    return Math.floor(whole / 86400) + "d " + two(Math.floor((whole % 86400) / 3600)) + "h";
  }

  function seconds(left) { return left <= 0 ? "ended" : duration(left); }

  // countdowns: every element with data-until ticks against the database's clock
  function tick() {
    var ended = false;
    var els = document.querySelectorAll("[data-until]");
    for (var i = 0; i < els.length; i++) {
      var until = parseFloat(els[i].getAttribute("data-until"));
      var left = until - dbNow();
      els[i].textContent = seconds(left);
      if (left <= 0 && !els[i].hasAttribute("data-ended")) {
        els[i].setAttribute("data-ended", "");
        ended = true;
      }
    }
    if (ended) { refresh(); } // renewed, or taken over? read the fragment again
  }

  function get(obj, path) {
    var parts = path.split(".");
    for (var i = 0; i < parts.length && obj !== null && obj !== undefined; i++) { obj = obj[parts[i]]; }
    return obj;
  }

  function text(value) { return value === null || value === undefined ? "—" : String(value); }

  // the series on a time axis: the last data-window seconds up to the snapshot's instant,
  // each point at its own (as pages.py _chart draws it: change both together)
  function chart(series, now) {
    var svg = document.getElementById("chart");
    if (!svg || typeof now !== "number") { return; }
    var span = parseFloat(svg.getAttribute("data-window")) || 60;
    var names = ["claims", "completions", "refused"];
    var peak = 1;
    series.forEach(function (p) { names.forEach(function (n) { if (p[n] !== null && p[n] > peak) { peak = p[n]; } }); });
    names.forEach(function (n) {
      var pts = [];
      series.forEach(function (p) {
        if (p[n] === null || now - p.at > span) { return; }
        var x = 600 - ((now - p.at) / span) * 600;
        var y = 155 - (p[n] / peak) * 150;
        pts.push(x.toFixed(1) + "," + y.toFixed(1));
      });
      var line = svg.querySelector("polyline." + n);
      if (line) { line.setAttribute("points", pts.join(" ")); }
    });
    var peakEl = document.getElementById("chart-peak");
    if (peakEl) { peakEl.textContent = Math.round(peak); }
  }

  // listings and the job's page: read their fragment again when the table moved
  function refresh() {
    var target = document.querySelector("[data-refresh]");
    if (!target || refreshing) { return; }
    refreshing = true;
    fetch(target.getAttribute("data-refresh"), { credentials: "same-origin", headers: { "Accept": "text/html" } })
      .then(function (r) { return r.ok ? r.text() : null; })
      .then(function (html) {
        if (html !== null) {
          var active = document.activeElement && document.activeElement.closest && document.activeElement.closest("[data-refresh]");
          if (!active) { target.innerHTML = html; } // never pull the rug from under a focused control
        }
      })
      .catch(function () {})
      .then(function () { refreshing = false; tick(); });
  }

  function onSnapshot(snap) {
    var err = document.getElementById("feed-error");
    if (err) { err.hidden = !snap.error; err.textContent = snap.error || ""; }
    if (snap.summary) {
      setOffset(snap.summary.now);
      var els = document.querySelectorAll("[data-live]");
      for (var i = 0; i < els.length; i++) { els[i].textContent = text(get(snap, els[i].getAttribute("data-live"))); }
      var ages = document.querySelectorAll("[data-live-age]");
      for (var j = 0; j < ages.length; j++) { ages[j].textContent = duration(get(snap, ages[j].getAttribute("data-live-age"))); }
    }
    chart(snap.series || [], snap.summary ? snap.summary.now : null);
    if (snap.changed) { refresh(); }
  }

  function connect() {
    if (!window.EventSource) { status.textContent = "no live updates in this browser"; return; }
    var source = new EventSource(root + "/events");
    source.addEventListener("snapshot", function (e) {
      status.textContent = "live";
      status.className = "live on";
      try { onSnapshot(JSON.parse(e.data)); } catch (ex) { /* a bad snapshot: wait for the next */ }
    });
    source.addEventListener("error", function () {
      status.textContent = "reconnecting…";
      status.className = "live off";
    });
  }

  // the page's data-now was the database's clock when the response started to arrive, not when
  // this script ran (a slow page would otherwise show every lease longer by its load time)
  var first = document.querySelector("[data-now]");
  if (first) {
    var pageNow = parseFloat(first.getAttribute("data-now"));
    var nav = window.performance && performance.getEntriesByType ? performance.getEntriesByType("navigation")[0] : null;
    if (nav && nav.responseStart > 0 && performance.timeOrigin) {
      offset = pageNow - (performance.timeOrigin + nav.responseStart) / 1000;
      known = true;
    } else {
      setOffset(pageNow);
    }
  }
  setInterval(tick, 100);
  connect();
})();
