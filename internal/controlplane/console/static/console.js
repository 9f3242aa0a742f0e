// better-compute console: polls the console's JSON endpoints for the token
// page (a machine joined) and the events page (new events). No inline
// script: the CSP allows only this file.
"use strict";
(function () {
  function getJSON(url, done) {
    fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } })
      .then(function (r) { return r.json(); })
      .then(done)
      .catch(function () {});
  }
  var created = document.getElementById("created");
  if (created) {
    var out = document.getElementById("joined");
    var timer = setInterval(function () {
      getJSON(created.dataset.poll, function (j) {
        if (j.nodes && j.nodes.length > 0) {
          var n = j.nodes[0];
          out.textContent = "Joined: node " + n.id + (n.hostname ? " (" + n.hostname + ")" : "") + ", " + n.state;
          out.className = "joined";
          clearInterval(timer);
        }
      });
    }, 1000);
  }
  var events = document.getElementById("events");
  if (events) {
    var body = events.querySelector("tbody");
    setInterval(function () {
      var url = events.dataset.poll + "&cursor=" + encodeURIComponent(events.dataset.cursor || "");
      getJSON(url, function (j) {
        if (j.cursor) { events.dataset.cursor = j.cursor; }
        (j.events || []).slice().reverse().forEach(function (e) {
          var tr = document.createElement("tr");
          [e.Time, e.Type, e.Subject, e.Data].forEach(function (v) {
            var td = document.createElement("td");
            td.textContent = v;
            tr.appendChild(td);
          });
          body.insertBefore(tr, body.firstChild);
        });
      });
    }, 2000);
  }
})();
