// tether ui: draws the page named by <body data-page> from the UI's JSON and live streams.
"use strict";

const props = JSON.parse(document.body.dataset.props || "{}");
const main = document.getElementById("main");
const crumbs = document.getElementById("crumbs");
const STATUSES = ["starting", "running", "completed", "error", "aborted", "interrupted"];

function esc(value) {
  return String(value ?? "").replace(/[&<>"']/g, (c) => ({
    "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));
}
const seg = encodeURIComponent;
function parentPath(agent, name) { return `${seg(agent)}/${seg(name)}`; }
function clock(ms) { return ms == null ? "—" : new Date(ms).toISOString().slice(11, 23); }
function span(ms) {
  if (ms == null) return "—";
  if (Math.abs(ms) < 1000) return `${ms} ms`;
  const s = ms / 1000;
  return s < 120 ? `${s.toFixed(1)} s` : `${Math.floor(s / 60)} min ${Math.round(s % 60)} s`;
}

async function api(path, options = {}) {
  const response = await fetch(path, {headers: {"Content-Type": "application/json"}, ...options});
  const body = await response.json().catch(() => ({}));
  if (!response.ok) throw new Error(body.error || `${response.status} ${response.statusText}`);
  return body;
}

function notice(text, failed = false) {
  const box = document.getElementById("notice");
  if (!box) return;
  box.textContent = text;
  box.className = failed ? "notice failed" : "notice";
}

async function act(path, body) {
  try {
    const answer = await api(path, {method: "POST", body: JSON.stringify(body || {})});
    notice(answer.message);
  } catch (error) {
    notice(error.message, true);
  }
}

// --- the index: parents with their counts by status -----------------------------------

async function indexPage() {
  main.innerHTML = `<h1>Parents</h1>
    <div class="toolbar"><input type="search" id="search" placeholder="Search parents (agent/name)"
      autofocus><span class="notice" id="notice"></span></div>
    <table id="parents"><thead><tr><th>Parent</th><th>Runs</th>
      ${STATUSES.map((s) => `<th>${s}</th>`).join("")}</tr></thead><tbody></tbody></table>`;
  const search = document.getElementById("search");
  const body = main.querySelector("#parents tbody");
  let parents = [];
  const draw = () => {
    const q = search.value.trim().toLowerCase();
    const shown = parents.filter((p) => `${p.agent}/${p.name}`.toLowerCase().includes(q));
    body.innerHTML = shown.length ? shown.map((p) => `<tr class="parent" data-parent="${esc(p.agent)}/${esc(p.name)}">
        <td><a href="/parents/${parentPath(p.agent, p.name)}">${esc(p.agent)}/${esc(p.name)}</a></td>
        <td>${p.total}</td>
        ${STATUSES.map((s) => `<td><span class="chip s-${s} ${p.counts[s] ? "" : "zero"}"
          data-status="${s}">${p.counts[s]}</span></td>`).join("")}</tr>`).join("")
      : `<tr><td colspan="${STATUSES.length + 2}" class="empty">No parents${q ? " match" : " yet"}.</td></tr>`;
  };
  search.addEventListener("input", draw);
  const load = async () => {
    try {
      parents = (await api("/api/parents")).parents;
      draw();
      document.body.dataset.loaded = "true";
    } catch (error) {
      notice(error.message, true);
    }
  };
  await load();
  setInterval(load, 2000);
}

// --- one run's card --------------------------------------------------------------------

function deadlineText(run, now) {
  const parts = [];
  if (run.finished) return "";
  if (run.max_budget_deadline) parts.push(`budget ${span(run.max_budget_deadline - now)} left`);
  if (run.no_progress_deadline) parts.push(`no-progress ${span(run.no_progress_deadline - now)} left`);
  return parts.join(" · ");
}

function waterfall(run) {
  const start = run.requested_at;
  const points = [run.started_at, run.ended_at, run.delivered_at].filter((t) => t != null);
  const end = points.length ? Math.max(...points) : Date.now();
  const total = Math.max(end - start, 1);
  const pieces = [];
  const add = (from, to, cls, label) => {
    if (from == null) return;
    const until = to ?? (run.finished ? from : Date.now());
    pieces.push([cls, Math.max(until - from, 0), label]);
  };
  add(start, run.started_at ?? run.ended_at, "wf-queue",
      run.started_at == null && run.ended_at == null ? "requested, waiting" : "requested → running");
  add(run.started_at, run.ended_at, "wf-run", run.ended_at == null ? "running so far" : "running → outcome");
  if (run.ended_at != null && run.delivered_at != null) {
    add(run.ended_at, run.delivered_at, "wf-deliver", "outcome → hook delivered");
  }
  const bars = pieces.map(([cls, ms, label]) =>
    `<span class="${cls}" style="width:${(100 * ms / total).toFixed(2)}%" title="${label}: ${span(ms)}"></span>`).join("");
  const legend = pieces.map(([, ms, label]) => `${label} ${span(ms)}`).join(" · ");
  return `<div class="waterfall" data-total="${total}">${bars}</div>
    <div class="waterfall-legend">${esc(legend)}</div>`;
}

function runCard(run, tree, options = {}) {
  const p = run.progress || {};
  const fraction = p.fraction ?? (run.status === "completed" ? 1 : null);
  const runUrl = `/runs/${parentPath(run.parent.agent, run.parent.name)}/${seg(run.run_id)}`;
  const actions = [];
  if (!run.finished) actions.push(`<button class="cancel danger" data-act="cancel">Cancel</button>`);
  if (run.status === "interrupted") {
    actions.push(`<button class="rerequest" data-act="rerequest">Re-request</button>`);
  }
  const pins = run.milestones.map((m) =>
    `<span class="pin" data-sequence="${m.sequence}" title="${esc(clock(m.at))}">${esc(m.name)}</span>`).join("");
  const children = tree.childrenOf(run);
  const meta = [
    `attempt ${run.attempt}`,
    run.detached ? "detached" : "awaited",
    `requested ${clock(run.requested_at)}`,
    run.waiting_for ? `waiting: ${esc(run.waiting_for)}` : "",
    run.cancel_requested && !run.finished ? "cancel requested" : "",
  ].filter(Boolean);
  return `<div class="run" data-run-id="${esc(run.run_id)}" data-status="${esc(run.status)}"
      ${run.waiting_for ? `data-waiting="${esc(run.waiting_for)}"` : ""}>
    <div class="run-head">
      <span class="badge s-${esc(run.status)} status">${esc(run.status)}</span>
      <span class="title">${esc(run.display || run.agent_type)}</span>
      <a class="id" href="${runUrl}">${esc(run.run_id)}</a>
      <span class="spacer"></span>
      <span class="deadline meta" data-budget="${run.max_budget_deadline ?? ""}"
        data-no-progress="${run.no_progress_deadline ?? ""}">${esc(deadlineText(run, Date.now()))}</span>
      ${options.actions === false ? "" : actions.join("")}
    </div>
    <div class="bar" data-fraction="${fraction ?? ""}"><div class="fill"
      style="width:${fraction == null ? 0 : (100 * fraction).toFixed(1)}%"></div></div>
    <div class="meta"><span class="phase">${esc(p.phase || "")}</span>
      <span class="message">${esc(p.message || "")}</span>${meta.map((m) => `<span>${m}</span>`).join("")}</div>
    ${pins ? `<div class="pins">${pins}</div>` : ""}
    ${run.output_text ? `<pre class="output">${run.output_truncated ? "…" : ""}${esc(run.output_text)}</pre>` : ""}
    ${run.summary ? `<div class="summary">${esc(run.summary)}</div>` : ""}
    ${run.error ? `<div class="problem">${esc(run.error)}</div>` : ""}
    ${run.status === "interrupted" ? `<div class="reason">reason: ${esc(run.reason)}
      · child still running: ${run.child_still_running == null ? "unknown" : run.child_still_running}</div>` : ""}
    ${waterfall(run)}
    ${children.length ? `<div class="children">${children.map((c) => runCard(c, tree, {actions: false})).join("")}</div>` : ""}
  </div>`;
}

function byOrder(a, b) {
  const ao = a.display_order ?? Infinity, bo = b.display_order ?? Infinity;
  return ao - bo || a.requested_at - b.requested_at || (a.run_id < b.run_id ? -1 : 1);
}

// Runs of the page and their nested runs (owned by `<agent type>/<run id>`).
class Tree {
  constructor() { this.runs = new Map(); this.nested = new Map(); }
  key(run) { return `${run.parent.agent}/${run.parent.name}/${run.run_id}`; }
  childrenOf(run) {
    const owner = `${run.agent_type}/${run.run_id}/`;
    return [...this.nested.values()].filter((c) => `${c.parent.agent}/${c.parent.name}/` === owner)
      .sort(byOrder);
  }
  rootOf(nested) {
    let current = nested;
    for (let depth = 0; depth < 8; depth += 1) {
      const owner = [...this.runs.values(), ...this.nested.values()].find(
        (r) => r.agent_type === current.parent.agent && r.run_id === current.parent.name);
      if (!owner) return null;
      if (this.runs.get(owner.run_id) === owner) return owner.run_id;
      current = owner;
    }
    return null;
  }
}

// --- a parent's timeline ----------------------------------------------------------------

function inboxItem(run) {
  const base = `/api/runs/${parentPath(run.parent.agent, run.parent.name)}/${seg(run.run_id)}`;
  const pending = run.pending.map((call) => `<div class="pending" data-call="${esc(call.tool_call_id)}">
      <b>${esc(call.tool_name)}</b> <code>${esc(JSON.stringify(call.input))}</code>
      <span class="meta">${esc(call.reason)}</span>
      ${call.reason === "approval" ? `<button class="approve primary" data-call="${esc(call.tool_call_id)}">Approve</button>
        <button class="reject danger" data-call="${esc(call.tool_call_id)}">Reject</button>`
        : `<input type="text" class="tool-output" placeholder='tool output as JSON, e.g. {"ok": true}'>
        <button class="give-output" data-call="${esc(call.tool_call_id)}">Give output</button>`}
    </div>`).join("");
  return `<div class="item" data-run-id="${esc(run.run_id)}" data-base="${esc(base)}">
    <div><b>${esc(run.display || run.agent_type)}</b> <span class="id">${esc(run.run_id)}</span>
      waits: ${esc(run.waiting_for)}</div>
    ${pending}
    <textarea class="human-input" placeholder="Your answer (human input)"></textarea>
    <button class="continue">Continue</button>
  </div>`;
}

function parentPage() {
  const {agent, name} = props;
  crumbs.innerHTML = `/ <a href="/parents/${parentPath(agent, name)}">${esc(agent)}/${esc(name)}</a>`;
  main.innerHTML = `<h1>${esc(agent)}/${esc(name)}</h1>
    <div class="toolbar"><span class="live" id="live" data-state="connecting">connecting…</span>
      <span id="counts"></span>
      <button id="clear-finished">Clear finished runs</button>
      <span class="notice" id="notice"></span></div>
    <section class="inbox" id="inbox-section" hidden><h2>Waiting for you</h2><div id="inbox"></div></section>
    <section id="timeline"></section>`;
  const tree = new Tree();
  const live = document.getElementById("live");
  const timeline = document.getElementById("timeline");
  let dirty = new Set(), full = true, scheduled = false;

  const schedule = () => {
    if (!scheduled) { scheduled = true; requestAnimationFrame(draw); }
  };
  function groups() {
    const runs = [...tree.runs.values()];
    const calls = new Map();
    for (const run of [...runs].sort((a, b) => a.requested_at - b.requested_at)) {
      if (run.parent_tool_call_id != null && !calls.has(run.parent_tool_call_id)) {
        calls.set(run.parent_tool_call_id, []);
      }
    }
    for (const run of runs) if (run.parent_tool_call_id != null) calls.get(run.parent_tool_call_id).push(run);
    const unbound = runs.filter((r) => r.parent_tool_call_id == null).sort(byOrder);
    return {calls, unbound};
  }
  function groupHtml(call, runs) {
    const title = call == null ? `<h2>Unbound runs</h2>` : `<div class="group-title">tool call ${esc(call)}</div>`;
    return `<div class="group" data-tool-call="${call == null ? "" : esc(call)}">${title}
      ${runs.map((r) => runCard(r, tree)).join("")}</div>`;
  }
  function groupOf(call) {
    const wanted = call == null ? "" : call;
    for (const group of timeline.children) {
      if (group.classList.contains("group") && group.dataset.toolCall === wanted) return group;
    }
    timeline.querySelector(".empty")?.remove();
    const holder = document.createElement("div");
    holder.innerHTML = groupHtml(call, []);
    const group = holder.firstElementChild;
    // Tool-call groups in the order their first run was requested; unbound runs last.
    const unbound = [...timeline.children].find((g) => g.dataset.toolCall === "");
    timeline.insertBefore(group, call == null ? null : unbound || null);
    return group;
  }
  function element(html) {
    const holder = document.createElement("div");
    holder.innerHTML = html;
    return holder.firstElementChild;
  }
  const cards = new Map();  // run id -> its card on the timeline
  function remember(scope) {
    for (const card of scope.querySelectorAll(".group > .run")) cards.set(card.dataset.runId, card);
  }
  // New runs go into their groups at their places, most often the end, in one insertion
  // per group: the cards already drawn stay as they are.
  function insert(runs) {
    const byCall = new Map();
    for (const run of runs.sort(byOrder)) {
      const call = run.parent_tool_call_id;
      if (!byCall.has(call)) byCall.set(call, []);
      byCall.get(call).push(run);
    }
    for (const [call, added] of byCall) {
      const group = groupOf(call);
      const last = group.lastElementChild?.classList.contains("run") ? group.lastElementChild : null;
      const lastRun = last && tree.runs.get(last.dataset.runId);
      if (!lastRun || byOrder(added[0], lastRun) > 0) {
        group.insertAdjacentHTML("beforeend", added.map((r) => runCard(r, tree)).join(""));
      } else {
        for (const run of added) {
          const before = [...group.querySelectorAll(":scope > .run")].find(
            (card) => byOrder(run, tree.runs.get(card.dataset.runId)) < 0);
          group.insertBefore(element(runCard(run, tree)), before || null);
        }
      }
      remember(group);
    }
  }
  function draw() {
    scheduled = false;
    if (full) {
      const {calls, unbound} = groups();
      let html = "";
      for (const [call, runs] of calls) html += groupHtml(call, runs.sort(byOrder));
      if (unbound.length) html += groupHtml(null, unbound);
      timeline.innerHTML = html || `<p class="empty">No runs yet.</p>`;
      cards.clear();
      remember(timeline);
    } else {
      const added = [];
      for (const runId of dirty) {
        const run = tree.runs.get(runId);
        const card = cards.get(runId);
        if (!run) continue;
        if (card && card.isConnected) {
          const fresh = element(runCard(run, tree));
          card.replaceWith(fresh);
          cards.set(runId, fresh);
        } else {
          added.push(run);
        }
      }
      if (added.length) insert(added);
    }
    dirty = new Set();
    full = false;
    drawInbox();
    drawCounts();
  }
  function drawInbox() {
    const waiting = [...tree.runs.values()].filter((r) => r.waiting_for && !r.finished).sort(byOrder);
    document.getElementById("inbox-section").hidden = waiting.length === 0;
    const inbox = document.getElementById("inbox");
    const shown = [...inbox.children].map((item) => item.dataset.runId + "|" + item.dataset.sig);
    const wanted = waiting.map((r) => r.run_id + "|" + JSON.stringify(r.pending));
    if (shown.join() === wanted.join()) return;  // keep what the user is typing
    inbox.innerHTML = waiting.map(inboxItem).join("");
    [...inbox.children].forEach((item, i) => { item.dataset.sig = JSON.stringify(waiting[i].pending); });
  }
  function drawCounts() {
    const counts = Object.fromEntries(STATUSES.map((s) => [s, 0]));
    for (const run of tree.runs.values()) counts[run.status] += 1;
    document.getElementById("counts").innerHTML = STATUSES.map((s) =>
      `<span class="chip s-${s} ${counts[s] ? "" : "zero"}" title="${s}" data-status="${s}">${counts[s]}</span>`).join("");
  }

  timeline.addEventListener("click", (click) => {
    const button = click.target.closest("button[data-act]");
    if (!button) return;
    const runId = button.closest(".run").dataset.runId;
    button.disabled = true;
    act(`/api/runs/${parentPath(agent, name)}/${seg(runId)}/${button.dataset.act}`);
  });
  document.getElementById("inbox").addEventListener("click", (click) => {
    const button = click.target.closest("button");
    if (!button) return;
    const item = button.closest(".item");
    const path = `${item.dataset.base}/continue`;
    if (button.classList.contains("approve")) act(path, {approvals: [button.dataset.call]});
    else if (button.classList.contains("reject")) act(path, {rejections: [button.dataset.call]});
    else if (button.classList.contains("give-output")) {
      const text = button.parentElement.querySelector(".tool-output").value;
      let value;
      try { value = JSON.parse(text); } catch (error) { notice(`tool output is not JSON: ${error.message}`, true); return; }
      act(path, {tool_outputs: {[button.dataset.call]: value}});
    } else if (button.classList.contains("continue")) {
      act(path, {human_input: item.querySelector(".human-input").value});
    }
  });
  document.getElementById("clear-finished").addEventListener("click", () =>
    act(`/api/parents/${parentPath(agent, name)}/clear`, {}));

  const source = new EventSource(`/api/parents/${parentPath(agent, name)}/stream`);
  source.addEventListener("snapshot", (message) => {
    const data = JSON.parse(message.data);
    tree.runs.clear(); tree.nested.clear();
    for (const run of data.runs) tree.runs.set(run.run_id, run);
    for (const run of data.nested) tree.nested.set(tree.key(run), run);
    full = true;
    live.dataset.state = "live"; live.textContent = "live";
    draw();
    document.body.dataset.loaded = "true";
  });
  source.addEventListener("update", (message) => {
    const data = JSON.parse(message.data);
    for (const run of data.runs) {
      tree.runs.set(run.run_id, run);
      dirty.add(run.run_id);
    }
    for (const runId of data.removed) { tree.runs.delete(runId); full = true; }
    for (const run of data.nested) {
      tree.nested.set(tree.key(run), run);
      const root = tree.rootOf(run);
      if (root) dirty.add(root); else full = true;
    }
    if (data.caught_up) { live.dataset.state = "caught-up"; live.textContent = "live, caught up"; }
    schedule();
  });
  source.addEventListener("failure", (message) => {
    live.dataset.state = "error"; live.textContent = JSON.parse(message.data).error;
  });
  source.onerror = () => { live.dataset.state = "error"; live.textContent = "disconnected, retrying…"; };
  setInterval(() => {
    const now = Date.now();
    for (const cell of timeline.querySelectorAll(".deadline")) {
      const run = tree.runs.get(cell.closest(".run").dataset.runId);
      if (run) cell.textContent = deadlineText(run, now);
    }
  }, 1000);
}

// --- one run's detail -------------------------------------------------------------------

function stateBlock(run) {
  if (!run) return `<p class="empty">No run at this sequence (not requested yet, or cleared).</p>`;
  const tree = new Tree();
  return runCard(run, tree, {actions: false});
}

function stepsTable(steps) {
  if (!steps.length) return `<p class="empty">No steps recorded.</p>`;
  const rows = steps.map((step) => {
    const turn = step.turn;
    const tools = (step.tool_results || []).map((t) =>
      `${esc(t.tool_name)} [${esc(t.decision)}]${t.is_error ? " ERROR" : ""}`).join(", ");
    const pending = (step.pending || []).map((p) => `${esc(p.tool_name)} (${esc(p.reason)})`).join(", ");
    return `<tr class="step"><td>${step.index}</td><td>${esc(step.kind)}</td><td>${step.call}</td>
      <td>${esc(step.model || "")}</td><td>${esc(step.status)}</td>
      <td>${turn ? `${turn.usage.input_tokens} in / ${turn.usage.output_tokens} out` : ""}</td>
      <td>${step.cost == null ? "" : "$" + step.cost.toFixed(6)}</td>
      <td>${tools}${pending ? ` waits: ${pending}` : ""}</td></tr>`;
  }).join("");
  return `<table><thead><tr><th>#</th><th>kind</th><th>call</th><th>model</th><th>status</th>
    <th>tokens</th><th>cost</th><th>tool calls</th></tr></thead><tbody>${rows}</tbody></table>`;
}

function runPage() {
  const {agent, name, run_id: runId} = props;
  const base = `/api/runs/${parentPath(agent, name)}/${seg(runId)}`;
  crumbs.innerHTML = `/ <a href="/parents/${parentPath(agent, name)}">${esc(agent)}/${esc(name)}</a> / ${esc(runId)}`;
  main.innerHTML = `<h1>${esc(runId)}</h1>
    <div class="toolbar"><span class="notice" id="notice"></span></div>
    <section id="current"></section>
    <section class="inbox" id="inbox-section" hidden><h2>Waiting for you</h2><div id="inbox"></div></section>
    <h2>State as of a sequence</h2>
    <div class="slider"><input type="range" id="slider" min="0" max="0" step="1" value="0">
      <span id="slider-seq"></span></div>
    <div class="as-of" id="as-of"></div>
    <h2>Steps</h2><div id="steps"></div><div id="usage" class="meta"></div>
    <h2>Events</h2><table id="events"><thead><tr><th>seq</th><th>type</th><th>at</th><th>data</th></tr></thead>
      <tbody></tbody></table>`;
  const slider = document.getElementById("slider");
  let events = [], following = true, asOfRequest = 0;

  async function showAsOf(index) {
    const event = events[index];
    if (!event) return;
    document.getElementById("slider-seq").textContent = `sequence ${event.seq} (${index + 1} of ${events.length}: ${event.type})`;
    for (const row of document.querySelectorAll("#events tbody tr")) {
      row.classList.toggle("past", Number(row.dataset.seq) > event.seq);
    }
    const ticket = ++asOfRequest;
    const answer = await api(`${base}/state?seq=${event.seq}`);
    if (ticket !== asOfRequest) return;  // a later position was asked for meanwhile
    const box = document.getElementById("as-of");
    box.dataset.seq = String(event.seq);
    box.innerHTML = stateBlock(answer.run);
  }
  slider.addEventListener("input", () => {
    following = Number(slider.value) === events.length - 1;
    showAsOf(Number(slider.value));
  });

  async function load() {
    let detail;
    try { detail = await api(base); } catch (error) { notice(error.message, true); return; }
    const run = detail.run;
    const actions = [];
    if (!run.finished) actions.push(`<button class="cancel danger" data-act="cancel">Cancel</button>`);
    if (run.status === "interrupted") actions.push(`<button class="rerequest" data-act="rerequest">Re-request</button>`);
    document.getElementById("current").innerHTML = `${runCard(run, new Tree(), {actions: false})}
      <div class="toolbar">${actions.join("")}</div>
      <div class="detail-grid"><div><h2>Input</h2><pre class="json">${esc(JSON.stringify(detail.input, null, 2))}</pre></div>
      <div><h2>Continuations</h2><pre class="json">${esc(JSON.stringify(detail.resumptions, null, 2))}</pre></div></div>`;
    const inbox = document.getElementById("inbox");
    document.getElementById("inbox-section").hidden = !(run.waiting_for && !run.finished);
    if (run.waiting_for && !run.finished && !inbox.querySelector(`[data-sig='${CSS.escape(JSON.stringify(run.pending))}']`)) {
      inbox.innerHTML = inboxItem(run);
      inbox.firstElementChild.dataset.sig = JSON.stringify(run.pending);
    }
    document.getElementById("steps").innerHTML = stepsTable(detail.steps);
    const usage = detail.usage;
    document.getElementById("usage").textContent = usage
      ? `usage: ${usage.input_tokens} in · ${usage.output_tokens} out · ${usage.cached_tokens} cached · cost ${usage.cost == null ? "unknown" : "$" + usage.cost.toFixed(6)}`
      : "";
    events = detail.events;
    document.querySelector("#events tbody").innerHTML = events.map((e) =>
      `<tr data-seq="${e.seq}"><td>${e.seq}</td><td>${esc(e.type)}</td><td>${esc(clock(e.occurred_at))}</td>
        <td><pre class="json">${esc(JSON.stringify(e.data))}</pre></td></tr>`).join("");
    slider.max = String(Math.max(events.length - 1, 0));
    if (following) slider.value = slider.max;
    await showAsOf(Number(slider.value));
    document.body.dataset.loaded = "true";
  }

  main.addEventListener("click", (click) => {
    const button = click.target.closest("button");
    if (!button) return;
    if (button.dataset.act) { button.disabled = true; act(`${base}/${button.dataset.act}`); return; }
    const item = button.closest(".item");
    if (!item) return;
    const path = `${base}/continue`;
    if (button.classList.contains("approve")) act(path, {approvals: [button.dataset.call]});
    else if (button.classList.contains("reject")) act(path, {rejections: [button.dataset.call]});
    else if (button.classList.contains("give-output")) {
      const text = button.parentElement.querySelector(".tool-output").value;
      try { act(path, {tool_outputs: {[button.dataset.call]: JSON.parse(text)}}); }
      catch (error) { notice(`tool output is not JSON: ${error.message}`, true); }
    } else if (button.classList.contains("continue")) {
      act(path, {human_input: item.querySelector(".human-input").value});
    }
  });

  // The run changes: the parent's stream says when; the detail is read again then.
  let pending = null;
  const source = new EventSource(`/api/parents/${parentPath(agent, name)}/stream`);
  const reload = () => { if (!pending) pending = setTimeout(() => { pending = null; load(); }, 100); };
  source.addEventListener("snapshot", reload);
  source.addEventListener("update", (message) => {
    const data = JSON.parse(message.data);
    if (data.runs.some((r) => r.run_id === runId) || data.removed.includes(runId)) reload();
  });
  load();
}

function missingPage() {
  main.innerHTML = `<h1>Not found</h1><p class="empty">${esc(props.message || "")}</p>`;
}

({index: indexPage, parent: parentPage, run: runPage, missing: missingPage})[document.body.dataset.page]();
