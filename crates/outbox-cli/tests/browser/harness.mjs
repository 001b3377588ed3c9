// What the browser tests share (dashboard.mjs, databases.mjs): their environment, checks, the
// browser and the report of the step that failed.
import { chromium } from "playwright-core";

// The environment variable `k`, which must be set.
export const env = (k) => {
  const v = process.env[k];
  if (!v) throw new Error(`${k} is not set`);
  return v;
};

// Log `what` as holding, or fail naming it.
export function check(cond, what) {
  if (!cond) throw new Error(`check failed: ${what}`);
  console.log(`ok: ${what}`);
}

// Confirm the open dialog.
export async function confirm(page) {
  await page.waitForSelector("#modal:not([hidden])");
  await page.click("#modal-ok");
}

// Wait until the page's toast reports a success saying `text`.
export async function toastSays(page, text) {
  await page.waitForFunction((text) => {
    const t = document.getElementById("toast");
    return !t.hidden && !t.classList.contains("error") && t.textContent.includes(text);
  }, text);
}

// Collect the page's errors from now on into the returned array: script errors, console errors
// whose text `consoleError` keeps, and responses whose status `failed` flags (by default every
// console error and every status from 400).
export function pageErrors(page, { consoleError = () => true, failed = (status) => status >= 400 } = {}) {
  const errors = [];
  page.on("pageerror", (e) => errors.push(String(e)));
  page.on("console", (m) => { if (m.type() === "error" && consoleError(m.text())) errors.push(m.text()); });
  page.on("response", (r) => { if (failed(r.status())) errors.push(`${r.status()} for ${r.url()}`); });
  return errors;
}

// Launch the browser (CHROMIUM, default /usr/bin/chromium), open a 1280×900 page and run
// `steps(page, step)`, where `step(name)` names the step under way. Exits 1 printing the step
// that failed (after `label`).
export async function drive(label, steps) {
  const browser = await chromium.launch({
    executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
    args: ["--headless", "--no-sandbox"],
  });
  let step = "start";
  try {
    const page = await browser.newPage({ viewport: { width: 1280, height: 900 } });
    await steps(page, (name) => {
      step = name;
    });
  } catch (e) {
    console.error(`${label}step "${step}": ${e.message}`);
    await browser.close();
    process.exit(1);
  }
  await browser.close();
}
