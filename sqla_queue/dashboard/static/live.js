// The overview's live refresh (sqla_queue dashboard). Runs only when the page has an
// element #live (the URL asked for it: ?live=N). Every N seconds it fetches the page's
// live parts from the URL in #live's data-url, with the ETag of the last answer: a 304
// means nothing changed, and nothing is touched. Otherwise each element with a
// data-live-id whose content changed is replaced by its new version; a queue that
// appeared or went away reloads the page. Hidden tabs do not poll.
(function () {
  "use strict";
  var box = document.getElementById("live");
  if (!box) {
    return;
  }
  var url = box.getAttribute("data-url");
  var every = Math.max(1, Number(box.getAttribute("data-every")) || 5) * 1000;
  var status = document.getElementById("live-status");
  var etag = null;

  function parts(root) {
    var found = new Map();
    root.querySelectorAll("[data-live-id]").forEach(function (element) {
      found.set(element.getAttribute("data-live-id"), element);
    });
    return found;
  }

  function apply(html) {
    var fresh = parts(new DOMParser().parseFromString(html, "text/html"));
    var here = parts(document);
    var same = fresh.size === here.size;
    fresh.forEach(function (_, id) {
      same = same && here.has(id);
    });
    if (!same) {
      window.location.reload();
      return 0;
    }
    var changed = 0;
    fresh.forEach(function (element, id) {
      var old = here.get(id);
      if (old.innerHTML !== element.innerHTML) {
        old.replaceWith(document.importNode(element, true));
        changed += 1;
      }
    });
    return changed;
  }

  function say(text, state) {
    if (status) {
      status.textContent = text;
      status.setAttribute("data-state", state);
    }
  }

  function poll() {
    if (document.hidden) {
      window.setTimeout(poll, every);
      return;
    }
    var headers = etag ? {"If-None-Match": etag} : {};
    fetch(url, {credentials: "same-origin", cache: "no-store", headers: headers})
      .then(function (response) {
        if (response.status === 304) {
          return null;
        }
        if (!response.ok) {
          throw new Error("HTTP " + response.status);
        }
        etag = response.headers.get("ETag");
        return response.text();
      })
      .then(function (html) {
        var changed = html === null ? 0 : apply(html);
        say("updated " + new Date().toLocaleTimeString() + (changed ? "" : " (no change)"), "ok");
      })
      .catch(function (error) {
        say("refresh failed: " + error.message, "error");
      })
      .then(function () {
        window.setTimeout(poll, every);
      });
  }

  window.setTimeout(poll, every);
})();
