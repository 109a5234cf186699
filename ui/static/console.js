// The console's own script (the Content-Security-Policy allows no inline script): the navigation's menu
// button on narrow screens, confirmations of forms that change what serves, and copy buttons.
// A button with data-copy="ID" copies the text of the element with that id, and says so; where the
// clipboard is not available (a page served over plain http to another host) it selects the text instead.
document.addEventListener("click", (event) => {
  const button = event.target instanceof Element ? event.target.closest("button[data-copy]") : null;
  if (!button) return;
  const source = document.getElementById(button.dataset.copy);
  if (!source) return;
  const text = source.textContent.trim();
  const done = (label) => {
    const status = document.getElementById(button.dataset.copy + "-copied");
    if (status) status.textContent = label;
  };
  const select = () => {
    const range = document.createRange();
    range.selectNodeContents(source);
    const selection = window.getSelection();
    selection.removeAllRanges();
    selection.addRange(range);
    done("Selected: press Ctrl+C (⌘C) to copy.");
  };
  if (navigator.clipboard && window.isSecureContext) {
    navigator.clipboard.writeText(text).then(() => done("Copied."), select);
  } else {
    select();
  }
});

// The menu button (shown on narrow screens only) opens and closes the navigation.
document.addEventListener("click", (event) => {
  const toggle = event.target instanceof Element ? event.target.closest("#nav-toggle") : null;
  if (!toggle) return;
  const open = toggle.getAttribute("aria-expanded") !== "true";
  toggle.setAttribute("aria-expanded", String(open));
  document.getElementById("topbar").classList.toggle("nav-open", open);
});

// A form with data-confirm="…" asks first; cancelling sends nothing.
document.addEventListener("submit", (event) => {
  const form = event.target instanceof HTMLFormElement ? event.target : null;
  const question = form && (event.submitter?.dataset.confirm || form.dataset.confirm);
  if (question && !window.confirm(question)) event.preventDefault();
}, true);

// "Go to line N" next to a policy issue selects that line in the editor and scrolls it into view.
document.addEventListener("click", (event) => {
  const jump = event.target instanceof Element ? event.target.closest("button.jump-line") : null;
  const editor = document.getElementById("policy-editor");
  if (!jump || !editor) return;
  const wanted = Number(jump.dataset.line);
  const lines = editor.value.split("\n");
  const index = Math.min(Math.max(wanted, 1), lines.length) - 1;
  const start = lines.slice(0, index).reduce((n, line) => n + line.length + 1, 0);
  editor.focus();
  editor.setSelectionRange(start, start + lines[index].length);
  const height = parseFloat(getComputedStyle(editor).lineHeight) || 20;
  editor.scrollTop = Math.max(0, (index - 3) * height);
  const where = document.getElementById("editor-line");
  if (where) where.textContent = `Line ${index + 1} selected.`;
});

// Where the caret is in the policy editor (a textarea shows no line numbers).
for (const kind of ["keyup", "click", "focus"]) {
  document.addEventListener(kind, (event) => {
    const editor = event.target;
    if (!(editor instanceof HTMLTextAreaElement) || editor.id !== "policy-editor") return;
    const where = document.getElementById("editor-line");
    if (!where) return;
    const line = editor.value.slice(0, editor.selectionStart).split("\n").length;
    where.textContent = `Line ${line} of ${editor.value.split("\n").length}.`;
  }, true);
}

// A valid candidate's publish button waits for the replay of what it would change (when one runs) to finish:
// the operator sees the consequences before publishing. The replay panel's answer, whatever it says, ends
// with #replay-done. Without this script the button is simply enabled (the server still checks everything).
function gatePublish() {
  const publish = document.getElementById("publish");
  if (!publish || publish.dataset.valid !== "true") return;
  const panel = document.getElementById("replay-panel");
  const waiting = Boolean(panel) && !panel.querySelector("[data-replay-done]");
  publish.disabled = waiting;
  const note = document.getElementById("publish-waiting");
  if (note) note.textContent = waiting ? "Publishing opens when the replay below has finished." : "";
}
document.addEventListener("DOMContentLoaded", gatePublish);
document.addEventListener("htmx:afterSettle", gatePublish);

// A table wider than the screen scrolls inside itself (narrow screens): it takes the keyboard focus then, so
// that it can be scrolled without a pointer.
function focusableWhenScrolling() {
  for (const table of document.querySelectorAll("main table")) {
    if (table.scrollWidth > table.clientWidth + 1) table.tabIndex = 0;
    else table.removeAttribute("tabindex");
  }
}
document.addEventListener("DOMContentLoaded", focusableWhenScrolling);
document.addEventListener("htmx:afterSettle", focusableWhenScrolling);
window.addEventListener("resize", focusableWhenScrolling);
