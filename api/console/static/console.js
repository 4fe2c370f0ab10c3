// Live parts of console pages: an element with data-live="URL" is replaced by the fragment at URL every
// data-live-seconds. A fragment that no longer carries data-live (its batch finished) stops the polling.
// A 401 (the session ended) reloads the page, which leads to the sign-in form.
"use strict";

function poll(element) {
  const url = element.dataset.live;
  const seconds = Number(element.dataset.liveSeconds || "5");
  window.setTimeout(async () => {
    if (!document.body.contains(element)) return;
    let response;
    try {
      response = await fetch(url, { credentials: "same-origin", headers: { "Accept": "text/html" } });
    } catch (unreachable) {
      poll(element);  // the API is restarting, or the network blinked: try again later
      return;
    }
    if (response.status === 401) { window.location.reload(); return; }
    if (!response.ok) {
      if (response.status >= 500) poll(element);  // a passing outage; a 4xx (the batch is gone) ends the polling
      return;
    }
    const holder = document.createElement("div");
    holder.innerHTML = await response.text();
    const fresh = holder.firstElementChild;
    if (!fresh) { poll(element); return; }
    // Keep the reader's place: which error groups are open, and the keyboard focus, survive the swap.
    const open = new Set(Array.from(element.querySelectorAll("details[open]"), (d) => d.dataset.code));
    fresh.querySelectorAll("details").forEach((d) => { if (open.has(d.dataset.code)) d.open = true; });
    const focused = element.contains(document.activeElement) ? twinSelector(document.activeElement) : null;
    element.replaceWith(fresh);
    const twin = focused && fresh.querySelector(focused);
    if (twin) twin.focus();
    if (fresh.dataset.live) poll(fresh);
  }, seconds * 1000);
}

// A selector for the same control in a fresh copy of the fragment: its id, or its link target.
function twinSelector(control) {
  if (control.id) return "#" + CSS.escape(control.id);
  if (control.getAttribute("href")) return `a[href="${CSS.escape(control.getAttribute("href"))}"]`;
  if (control.tagName === "SUMMARY" && control.parentElement.dataset.code) {
    return `details[data-code="${CSS.escape(control.parentElement.dataset.code)}"] > summary`;
  }
  return null;
}

document.addEventListener("DOMContentLoaded", () => {
  document.querySelectorAll("[data-live]").forEach(poll);
});
