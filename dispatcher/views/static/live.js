// renderfleet monitor: keep the figures live by polling /api/status (plain JS, no build step, nothing from a CDN).
"use strict";
(function () {
  function fmtDuration(s) {
    if (s === null || s === undefined) return "-";
    s = Math.round(s);
    if (s >= 3600) return Math.floor(s / 3600) + "h" + String(Math.floor((s % 3600) / 60)).padStart(2, "0") + "m";
    if (s >= 60) return Math.floor(s / 60) + "m" + String(s % 60).padStart(2, "0") + "s";
    return s + "s";
  }
  // as dispatcher/views/show.py's ago(): how long ago a job was submitted
  function ago(t) {
    if (!t) return "-";
    var s = Math.max(0, Math.floor(Date.now() / 1000 - t));
    if (s < 60) return s + "s ago";
    if (s < 3600) return Math.floor(s / 60) + "m ago";
    if (s < 86400) return Math.floor(s / 3600) + "h" + String(Math.floor((s % 3600) / 60)).padStart(2, "0") + "m ago";
    return Math.floor(s / 86400) + "d ago";
  }
  function seen(t) {
    if (!t) return "-";
    var age = Date.now() / 1000 - parseFloat(t);
    return age < 30 ? "up" : "silent " + fmtDuration(age);
  }
  // as dispatcher/views/show.py's money(): never rounded to nothing
  function money(v) {
    if (v === null || v === undefined) return "-";
    if (v === 0) return "$0";
    if (v >= 1000) return "$" + Math.round(v).toLocaleString("en-US");
    if (v >= 1) return "$" + v.toLocaleString("en-US", { minimumFractionDigits: 2, maximumFractionDigits: 2 });
    return "$" + (v >= 1e-4 ? String(Number(v.toPrecision(3))) : v.toExponential(2));
  }
  function set(row, cls, text) { var el = row.querySelector("." + cls); if (el) el.textContent = text; }

  function update(data) {
    data.jobs.forEach(function (j) {
      document.querySelectorAll('tr[data-job="' + CSS.escape(j.job) + '"]').forEach(function (row) {
        // rendered in green, quarantined in red: a job all quarantined is never a green bar
        row.querySelector(".fill").style.width = (j.total ? 100 * j.done / j.total : 0).toFixed(1) + "%";
        row.querySelector(".fill-q").style.width = (j.total ? 100 * j.quarantined / j.total : 0).toFixed(1) + "%";
        set(row, "f-submitted", ago(j.submitted));
        set(row, "f-priority", j.priority);
        set(row, "f-done", j.done);
        set(row, "f-quarantined", j.quarantined);
        set(row, "f-rate", j.images_per_minute.toFixed(1));
        set(row, "f-eta", j.state === "running" ? fmtDuration(j.eta_seconds) : j.state === "finished" ? "done" : j.state);
        set(row, "f-redeliveries", j.redeliveries + " / " + j.wasted_images);
        var gpu = Object.values(j.gpu_seconds).reduce(function (a, b) { return a + b; }, 0);
        set(row, "f-gpu", j.unaccounted ? "-" : gpu.toFixed(1));  // render time lost with a Redis: unknown
        set(row, "f-cost", money(j.cost) + (j.budget === null || j.budget === undefined ? "" : " of " + money(j.budget)));
        set(row, "f-cpk", money(j.cost_per_1000_images));
      });
      // a job with a budget, on its own page: its spend and its projected cost
      document.querySelectorAll('[data-budget="' + CSS.escape(j.job) + '"]').forEach(function (box) {
        set(box, "f-spent", money(j.cost));
        set(box, "f-projected", money(j.projected_cost));
      });
      // a job with stages, on its own page: each stage's figures and the one that bounds the rate
      if (j.stages) document.querySelectorAll('[data-stages="' + CSS.escape(j.job) + '"]').forEach(function (box) {
        j.stages.forEach(function (s) {
          var row = box.querySelector('tr[data-stage="' + CSS.escape(s.stage) + '"]');
          if (!row) return;
          set(row, "f-images", s.images);
          set(row, "f-spi", s.seconds_per_image === null ? "-" : String(Number(s.seconds_per_image.toPrecision(3))));
          set(row, "f-stage-gpu", s.gpu_seconds.toFixed(1));
          set(row, "f-share", s.share === null ? "-" : Math.round(100 * s.share) + "%");
          row.classList.toggle("bound", s.stage === j.bound_by);
        });
        set(box, "f-bound", j.bound_by || "no stage yet");
        set(box, "f-cpfi", money(j.cost_per_final_image));
      });
    });
    var el = document.getElementById("backlog-images");
    if (el && data.backlog_images !== undefined) el.textContent = data.backlog_images;
    el = document.getElementById("jobs-matching");
    if (el && data.matching !== undefined) el.textContent = data.matching;
    el = document.getElementById("backlog-seconds");
    if (el) el.textContent = Math.round(data.backlog_seconds);
    document.querySelectorAll(".queue[data-queue]").forEach(function (q) {
      var n = data.queues[q.dataset.queue];
      if (n !== undefined) q.textContent = n;
    });
    el = document.getElementById("worker-count");
    if (el) el.textContent = data.workers.length;
    el = document.getElementById("workers");
    if (el) {
      el.textContent = "";
      data.workers.forEach(function (w) {
        var tr = document.createElement("tr");
        [w.worker, w.pool, w.model, w.device, seen(w.last_seen), w.images || 0, w.batches || 0].forEach(function (v) {
          var td = document.createElement("td"); td.textContent = v; tr.appendChild(td);
        });
        el.appendChild(tr);
      });
    }
  }

  // The jobs of the page shown (its filter and page: the same query), and only when something changed:
  // the server answers 304 to the ETag of the last answer.
  var etag = null;
  function pageQuery() {
    // a job's own page (/jobs/<id>, its query the gallery's page): that job, found by its id
    var m = window.location.pathname.match(/^\/jobs\/([^\/]+)$/);
    if (m) return "/api/page?q=" + encodeURIComponent(decodeURIComponent(m[1]));
    return "/api/page" + window.location.search;
  }
  function poll() {
    var headers = etag ? { "If-None-Match": etag } : {};
    fetch(pageQuery(), { credentials: "same-origin", headers: headers })
      .then(function (r) {
        if (r.status === 304) return null;
        if (!r.ok) throw new Error(r.status);
        etag = r.headers.get("ETag");
        return r.json();
      })
      .then(function (data) { if (data) update(data); document.getElementById("live-state").textContent = ""; })
      .catch(function (e) { document.getElementById("live-state").textContent = "(not updating: " + e.message + ")"; })
      .finally(function () { setTimeout(poll, 2000); });
  }

  // The gallery: prompt, seed and size on hover (title) and on click (the detail panel).
  function meta(fig) {
    if (!fig._meta) fig._meta = fetch(fig.dataset.meta, { credentials: "same-origin" }).then(function (r) { return r.json(); });
    return fig._meta;
  }
  function describe(m) {
    return m.prompt + "\nseed " + m.seed + " \u00b7 " + m.size + (m.steps ? " \u00b7 " + m.steps + " steps" : "") +
      (m.preview ? "\n" + m.preview : "");
  }
  // A job's events, live: server-sent from the monitor's stream (docs/monitoring.md, "Events").
  var EVENT_TYPES = ["job.started", "job.stage_finished", "job.prompts_quarantined", "job.cancelled",
    "job.budget_reached", "job.finished"];
  function followEvents(section) {
    var list = section.querySelector("ol.events");
    var source = new EventSource(section.dataset.events, { withCredentials: true });
    EVENT_TYPES.forEach(function (type) {
      source.addEventListener(type, function (ev) {
        var e = JSON.parse(ev.data), d = e.data || {};
        var li = document.createElement("li");
        li.textContent = (e.timestamp || "").replace("T", " ").replace(/\.\d+Z$/, "Z") + "  " + type.slice(4) +
          (d.stage ? " " + d.stage : "") + ": " + d.done + "/" + d.total + " done, " + d.quarantined + " quarantined" +
          (d.failure ? " (" + d.failure + ")" : "");
        list.append(li);
      });
    });
  }
  document.addEventListener("DOMContentLoaded", function () {
    var events = document.getElementById("events");
    if (events && window.EventSource) followEvents(events);
    // The bars' widths from the page (the Content-Security-Policy admits no inline style attribute).
    document.querySelectorAll(".fill[data-percent], .fill-q[data-percent]").forEach(function (el) { el.style.width = el.dataset.percent + "%"; });
    setTimeout(poll, 2000);
    var detail = document.getElementById("detail");
    document.querySelectorAll("figure.thumb").forEach(function (fig) {
      fig.addEventListener("mouseenter", function () {
        meta(fig).then(function (m) { fig.querySelector("img").title = describe(m); });
      });
      fig.querySelector("a").addEventListener("click", function (ev) {
        if (ev.ctrlKey || ev.metaKey || ev.shiftKey) return;
        ev.preventDefault();
        meta(fig).then(function (m) {
          detail.hidden = false;
          detail.textContent = "";
          var img = document.createElement("img");
          img.src = fig.querySelector("a").href;
          var p = document.createElement("pre");
          p.textContent = m.name + "\n" + describe(m) + (m.negative_prompt ? "\nnegative: " + m.negative_prompt : "") +
            (m.model ? "\nmodel " + m.model : "");
          var a = document.createElement("a"); a.href = img.src; a.textContent = "full size"; a.target = "_blank";
          detail.append(img, p, a);
        });
      });
    });
  });
})();
