// Live workflow view: poll the fragment, swap it in when the workflow changed (204 = unchanged).
"use strict";
(function () {
  const live = document.getElementById("live");
  if (live) {
    let mark = live.dataset.mark;
    const every = Number(live.dataset.poll) || 1000;
    const poll = async () => {
      try {
        const typing = live.contains(document.activeElement) && document.activeElement.tagName === "INPUT";
        if (!document.hidden && !typing) {
          const response = await fetch(live.dataset.src + "?mark=" + encodeURIComponent(mark),
                                       { credentials: "same-origin", cache: "no-store" });
          if (response.status === 200) {
            live.innerHTML = await response.text();
            mark = response.headers.get("X-Saga-Mark") || "";
            live.dataset.mark = mark;
          }
        }
      } catch (e) { /* the console or the network is away for a moment: try again next time */ }
      setTimeout(poll, every);
    };
    setTimeout(poll, every);
  }
  const all = document.getElementById("select-all");
  if (all) {
    all.addEventListener("change", () => {
      for (const box of document.querySelectorAll("input[name=workflow]")) box.checked = all.checked;
    });
  }
})();
