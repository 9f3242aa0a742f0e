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
  // fieldsCell is an event's data as the page renders it: a list of
  // key and value, one a line.
  function fieldsCell(fields) {
    var td = document.createElement("td");
    var dl = document.createElement("dl");
    dl.className = "fields";
    fields.forEach(function (f) {
      var div = document.createElement("div");
      var dt = document.createElement("dt");
      var dd = document.createElement("dd");
      dt.textContent = f.key;
      dd.textContent = f.value;
      div.appendChild(dt);
      div.appendChild(dd);
      dl.appendChild(div);
    });
    td.appendChild(dl);
    return td;
  }
  var created = document.getElementById("created");
  if (created) {
    var out = document.getElementById("joined");
    var timer = setInterval(function () {
      // The nodes that joined with this token (the node.joined events
      // that name it), not whatever else joined the pool.
      var url = created.dataset.poll + "&cursor=" + encodeURIComponent(created.dataset.cursor || "");
      getJSON(url, function (j) {
        if (j.cursor) { created.dataset.cursor = j.cursor; }
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
          [e.Time, e.Type, e.Subject].forEach(function (v) {
            var td = document.createElement("td");
            td.textContent = v;
            tr.appendChild(td);
          });
          tr.appendChild(fieldsCell(e.Data || []));
          body.insertBefore(tr, body.firstChild);
        });
      });
    }, 2000);
  }
})();
