// The dashboard in a real browser (Debian's chromium driven by playwright-core), against a running
// `outbox relay` on PostgreSQL and NATS (crates/outbox-cli/tests/daemon/dashboard.rs starts it and
// passes what it made in the environment):
//   DASH_URL        the admin listener, e.g. http://127.0.0.1:9464
//   DASH_TOKEN      the admin token
//   DASH_FAILED_ID  the row id of a dead letter on a routed topic
//   DASH_FAILED_MID its message id
//   DASH_KEY        a partition key held by several messages
//   DASH_INBOX_DISCARD, DASH_INBOX_REPLAY  message ids of two dead letters of consumer "inventory"
//   DASH_SHOTS      where to write a screenshot of each page
//   CHROMIUM        the browser (default /usr/bin/chromium)
// Exits 0 when every step holds; otherwise prints the step that failed and exits 1.
import { check, confirm, drive, env, pageErrors, toastSays } from "./harness.mjs";

const base = env("DASH_URL");
const token = env("DASH_TOKEN");
const failedId = env("DASH_FAILED_ID");
const undecidedId = env("DASH_UNDECIDED_ID");
const failedMid = env("DASH_FAILED_MID");
const key = env("DASH_KEY");
const shots = env("DASH_SHOTS");
const inboxDiscard = env("DASH_INBOX_DISCARD");
const inboxReplay = env("DASH_INBOX_REPLAY");

await drive("dashboard ", async (page, step) => {
  const consoleErrors = pageErrors(page, {
    // Script errors only: a refused request (the 401 below) is logged as a failed resource load.
    consoleError: (text) => !text.startsWith("Failed to load resource"),
    failed: (status) => status === 404,
  });

  step("overview");
  await page.goto(base + "/");
  await page.waitForSelector("#state-cards .card");
  const failedCount = async () => Number((await page.textContent('#state-cards [data-state="FAILED"] .n')).replace(/\D/g, ""));
  const before = await failedCount();
  check(before >= 1, `the overview shows ${before} dead letter(s)`);
  check((await page.textContent("main")).includes("orders.created"), "the overview lists the topic");
  await page.screenshot({ path: `${shots}/overview.png`, fullPage: true });

  step("search by message id");
  await page.click('a[data-nav="messages"]');
  await page.waitForSelector("#filters");
  await page.fill('input[name="message_id"]', failedMid);
  await page.click("#search");
  await page.waitForFunction((id) => {
    const rows = document.querySelectorAll("#results tbody tr[data-id]");
    return rows.length === 1 && rows[0].dataset.id === id;
  }, failedId);
  check(true, `the search by message id finds row ${failedId} alone`);

  step("search by key");
  await page.click("#clear");
  await page.waitForFunction(() => !document.querySelector('input[name="message_id"]').value);
  await page.fill('input[name="key"]', key);
  await page.click("#search");
  // Clearing the filters lists every key first: wait for the key's own results, not for any
  // two rows (the list of the cleared search raced the keyed one).
  await page
    .waitForFunction((k) => {
      const tds = [...document.querySelectorAll("#results tbody tr[data-id] td:nth-child(5)")];
      return tds.length >= 2 && tds.every((td) => td.textContent === k);
    }, key, { timeout: 10000 })
    .catch(() => {});
  const keys = await page.$$eval("#results tbody tr[data-id] td:nth-child(5)", (tds) => tds.map((td) => td.textContent));
  check(keys.length >= 2 && keys.every((k) => k === key), `the search by key finds ${keys.length} messages of key ${key}`);
  await page.screenshot({ path: `${shots}/messages.png`, fullPage: true });

  step("open the dead letter");
  await page.goto(`${base}/#/messages/${failedId}`);
  await page.waitForFunction((id) => document.querySelector("main h1")?.textContent.startsWith(`Message ${id} `), failedId);
  const detail = await page.textContent("main");
  check(detail.includes("FAILED") && detail.includes("simulated broker refusal"), "the detail shows the state and the last error");
  check((await page.textContent("#payload")).includes('"order"'), "the payload is shown (JSON, pretty-printed)");
  await page.screenshot({ path: `${shots}/message.png`, fullPage: true });

  step("requeue without a token is refused");
  await page.click('button[data-one="requeue"]');
  await page.waitForSelector("#modal:not([hidden])");
  await page.screenshot({ path: `${shots}/confirm.png` });
  await page.click("#modal-ok");
  await page.waitForSelector("#toast.error:not([hidden])");
  check((await page.textContent("#toast")).includes("token"), "without the token the requeue is refused, naming the token");

  step("requeue with the token");
  await page.fill("#token", token);
  await page.dispatchEvent("#token", "change");
  await page.click('button[data-one="requeue"]');
  await confirm(page);
  await toastSays(page, "1 changed");
  check(true, "the requeue reports 1 changed");

  step("the counts change");
  const deadline = Date.now() + 20000;
  let after = before;
  while (Date.now() < deadline) {
    await page.goto(base + "/#/");
    await page.waitForSelector("#state-cards .card");
    after = await failedCount();
    if (after === before - 1) break;
    await page.waitForTimeout(250);
  }
  check(after === before - 1, `the FAILED count went from ${before} to ${after}`);
  await page.screenshot({ path: `${shots}/overview-after.png`, fullPage: true });

  step("the relay published it");
  let state = "";
  const published = Date.now() + 20000;
  while (Date.now() < published) {
    const r = await page.request.get(`${base}/api/messages/${failedId}`);
    state = (await r.json()).status;
    if (state === "SENT") break;
    await page.waitForTimeout(250);
  }
  check(state === "SENT", `the requeued message is ${state}`);

  step("an undecided two-phase message");
  await page.goto(`${base}/#/messages/${undecidedId}`);
  await page.waitForFunction((id) => document.querySelector("main h1")?.textContent.startsWith(`Message ${id} `), undecidedId);
  check((await page.textContent("main")).includes("UNDECIDED"), "the detail shows UNDECIDED");
  check((await page.textContent("main")).includes("15 check-backs answered UNKNOWN"), "and why it was parked");
  await page.screenshot({ path: `${shots}/undecided.png`, fullPage: true });
  await page.click('button[data-one="resume"]');
  await confirm(page);
  await toastSays(page, "Resume: 1 changed");
  const resumed = await (await page.request.get(`${base}/api/messages/${undecidedId}`)).json();
  check(resumed.status === "PREPARED", `the resumed message is ${resumed.status}, checked back again`);

  step("the overview's charts");
  // The daemon samples its relay's counters every 10 s: wait for a sample that saw the publishes.
  const sampled = Date.now() + 30000;
  let points = [];
  while (Date.now() < sampled) {
    const r = await page.request.get(`${base}/api/series`);
    points = (await r.json()).points || [];
    if (points.some((p) => p.published > 0)) break;
    await page.waitForTimeout(500);
  }
  check(points.some((p) => p.published > 0), `the series has ${points.length} point(s) with publishes`);
  // The page is already at #/: reload it so the overview reads the series again.
  await page.goto(base + "/#/");
  await page.reload();
  await page.waitForSelector("#chart-throughput svg rect");
  await page.waitForSelector("#chart-latency svg");
  check((await page.textContent("#charts")).includes("Commit → ack"), "the overview shows the throughput and latency charts");
  await page.screenshot({ path: `${shots}/overview-charts.png`, fullPage: true });

  step("relays");
  await page.click('a[data-nav="relays"]');
  await page.waitForSelector("main table");
  check((await page.textContent("#relays")).includes("dash-relay"), "the relays page lists the running relay");
  check((await page.textContent("#relays")).includes("alive"), "the relay is shown alive");
  const counts = await page.$$eval("#buckets tbody tr td:nth-child(2)", (tds) => tds.map((td) => Number(td.textContent)));
  check(counts.reduce((a, b) => a + b, 0) === 64, "every bucket is listed");
  check((await page.textContent("#buckets")).includes("dash-relay"), "the buckets show their owner");
  await page.screenshot({ path: `${shots}/relays.png`, fullPage: true });

  step("blocked keys");
  await page.click('a[data-nav="keys"]');
  await page.waitForSelector("#keys");
  check((await page.textContent("#keys")).includes("No key is held back"), "no key is held back (the route skips dead letters)");

  step("inbox dead letters");
  await page.click('a[data-nav="inbox"]');
  await page.waitForSelector("#dead-letters");
  check((await page.textContent("#consumers")).includes("inventory"), "the inbox page lists the consumer with dead letters");
  const listed = await page.$$eval("#dead-letters input.dl-pick", (is) => is.map((i) => i.value));
  check(listed.includes(inboxDiscard) && listed.includes(inboxReplay), "both dead letters are listed");
  await page.screenshot({ path: `${shots}/inbox.png`, fullPage: true });

  step("open an inbox dead letter and discard it");
  await page.click(`a[href="#/inbox/inventory/${inboxDiscard}"]`);
  await page.waitForSelector("dl.fields");
  const dl = await page.textContent("main");
  check(dl.includes("stock service said no") && dl.includes("order-70"), "the dead letter shows its error and key");
  check((await page.textContent("#payload")).includes('"order"'), "its payload is shown");
  await page.screenshot({ path: `${shots}/inbox-dead-letter.png`, fullPage: true });
  await page.click('button[data-dl="discard"]');
  await confirm(page);
  await page.waitForSelector("#dead-letters");
  await toastSays(page, "1 changed");
  check(true, "the discard reports 1 changed");

  step("replay the other");
  await page.goto(`${base}/#/inbox?consumer=inventory`);
  await page.waitForFunction((id) => {
    const ids = [...document.querySelectorAll("#dead-letters input.dl-pick")].map((i) => i.value);
    return ids.length === 1 && ids[0] === id;
  }, inboxReplay);
  check(true, "one dead letter is left");
  await page.check(`#dead-letters input.dl-pick[value="${inboxReplay}"]`);
  await page.click("#dl-replay");
  await confirm(page);
  await page.waitForFunction(() => (document.querySelector("#dead-letters")?.textContent || "").includes("replay requested"));
  check(true, "the dead letter shows its replay requested");

  check(consoleErrors.length === 0, `no script errors (${consoleErrors.join("; ")})`);
});
