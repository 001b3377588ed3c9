// The admin surface of a daemon relaying several databases (`[[databases]]`), in a real browser
// (Debian's chromium driven by playwright-core), against a running `outbox relay`
// (crates/outbox-cli/tests/daemon/databases.rs starts it and passes in the environment):
//   DBS_URL      the admin listener, e.g. http://127.0.0.1:9464
//   DBS_MEMBERS  the members' names, comma-separated (a tenant's is <name>/<schema>)
//   DBS_OPEN     the member whose dashboard to open from the list
//   DBS_TOPIC    a topic of that member's table (shown on its overview)
//   DBS_OTHER    a topic of another member (not shown on it)
//   DBS_SHOTS    where to write a screenshot of each page
//   CHROMIUM     the browser (default /usr/bin/chromium)
// Exits 0 when every step holds; otherwise prints the step that failed and exits 1.
import { check, drive, env, pageErrors } from "./harness.mjs";

const base = env("DBS_URL");
const members = env("DBS_MEMBERS").split(",");
const open = env("DBS_OPEN");
const topic = env("DBS_TOPIC");
const other = env("DBS_OTHER");
const shots = env("DBS_SHOTS");

await drive("", async (page, step) => {
  const errors = pageErrors(page);

  step("the list of databases");
  await page.goto(base + "/");
  const rows = await page.$$eval("table tr td:first-child", (tds) => tds.map((td) => td.textContent.trim()));
  for (const m of members) check(rows.includes(m), `the list names ${m}`);
  const states = await page.$$eval("td.ok", (tds) => tds.length);
  check(states === members.length, `every database is running (${states} of ${members.length})`);
  await page.screenshot({ path: `${shots}/databases.png`, fullPage: true });

  step("a database's dashboard, opened from the list");
  await page.click(`text=${open}`);
  await page.waitForSelector("#state-cards .card");
  check(page.url().endsWith(`/databases/${open.replace("/", "~")}/`), `at ${page.url()}`);
  check((await page.textContent("header .brand")).includes(open), "the header names the database");
  const main = await page.textContent("main");
  check(main.includes(topic), `its overview lists its topic ${topic}`);
  check(!main.includes(other), `and not another database's topic ${other}`);
  await page.screenshot({ path: `${shots}/member-overview.png`, fullPage: true });

  step("its messages");
  await page.click('a[data-nav="messages"]');
  await page.waitForSelector("#filters");
  await page.waitForSelector("tr[data-id]");
  check((await page.textContent("main")).includes(topic), "its messages are listed");
  await page.screenshot({ path: `${shots}/member-messages.png`, fullPage: true });

  step("back to the list");
  await page.click("header .brand a.back");
  await page.waitForSelector("table td.ok");
  check(page.url() === base + "/", `back at ${page.url()}`);

  step("no errors");
  check(errors.length === 0, `no script error or failed request (${errors.join("; ")})`);
});
