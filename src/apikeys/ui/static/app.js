// The settings UI works without JavaScript; this adds a copy button and greys out the
// scopes while "Full access" is chosen.
"use strict";

async function copyFrom(input) {
  try {
    await navigator.clipboard.writeText(input.value);
    return true;
  } catch (error) {
    input.focus();
    input.select();
    return document.execCommand && document.execCommand("copy");
  }
}

document.addEventListener("click", async (event) => {
  const button = event.target.closest("[data-copy]");
  if (!button) return;
  const input = document.getElementById(button.dataset.copy);
  if (!input) return;
  const copied = await copyFrom(input);
  button.textContent = copied ? "Copied" : "Select and copy";
  setTimeout(() => { button.textContent = "Copy"; }, 2500);
});

document.addEventListener("focusin", (event) => {
  if (event.target.classList && event.target.classList.contains("key-input")) {
    event.target.select();
  }
});

function syncScopes() {
  const full = document.querySelector('input[name="access"][value="full"]');
  const picker = document.getElementById("scopes-picker");
  if (full && picker) picker.disabled = full.checked;
}

document.addEventListener("change", (event) => {
  if (event.target.name === "access") syncScopes();
});
document.addEventListener("DOMContentLoaded", syncScopes);
