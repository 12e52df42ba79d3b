// tether ui: draws the page named by <body data-page> from the UI's JSON and live streams;
// runs.js (loaded first) draws the runs.
"use strict";

const props = JSON.parse(document.body.dataset.props || "{}");
const main = document.getElementById("main");
const crumbs = document.getElementById("crumbs");

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

// --- a parent's timeline ----------------------------------------------------------------

function parentPage() {
  const {agent, name} = props;
  crumbs.innerHTML = `/ <a href="/parents/${parentPath(agent, name)}">${esc(agent)}/${esc(name)}</a>`;
  main.innerHTML = `<h1>${esc(agent)}/${esc(name)}</h1>
    <div class="toolbar"><span class="live" id="live" data-state="connecting">connecting…</span>
      <span id="counts"></span>
      <button id="clear-finished">Clear finished runs</button>
      <span class="notice" id="notice"></span></div>
    <section class="inbox" id="inbox-section" hidden><h2>Waiting for you</h2><div id="inbox"></div></section>
    <section class="send" id="send-section" hidden><h2>Send a message</h2>
      <textarea id="send-text" rows="2" placeholder="What to tell the child: it takes it in at its next step"></textarea>
      <label><input type="checkbox" id="send-interrupt"> interrupt what it is doing now</label>
      <button class="send-message" data-send="1">Send</button></section>
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
    const sigs = waiting.map((r) => JSON.stringify(waitingTarget(r, tree).pending));
    const wanted = waiting.map((r, i) => r.run_id + "|" + sigs[i]);
    if (shown.join() === wanted.join()) return;  // keep what the user is typing
    inbox.innerHTML = waiting.map((r) => inboxItem(r, tree)).join("");
    [...inbox.children].forEach((item, i) => { item.dataset.sig = sigs[i]; });
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
  let unreadable = 0;  // events of the log this page could not read, since it was opened
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
    if (data.unreadable_count) {
      // Something was in the log that no run shows: say so rather than leave a gap.
      unreadable += data.unreadable_count;
      const last = data.unreadable[data.unreadable.length - 1].line;
      notice(unreadable > 1 ? `${unreadable} events could not be read; the last: ${last}` : last, true);
    }
    schedule();
  });
  source.addEventListener("failure", (message) => {
    live.dataset.state = "error"; live.textContent = JSON.parse(message.data).error;
  });
  source.onerror = () => {
    // Keep a failure the server explained; the browser reconnects by itself either way.
    if (live.dataset.state !== "error") live.textContent = "disconnected, retrying…";
    live.dataset.state = "error";
  };
  setInterval(() => {
    const now = Date.now();
    for (const cell of timeline.querySelectorAll(".deadline")) {
      const run = tree.runs.get(cell.closest(".run").dataset.runId);
      if (run) cell.textContent = deadlineText(run, now);
    }
  }, 1000);
}

// --- one run's detail -------------------------------------------------------------------

function runPage() {
  const {agent, name, run_id: runId} = props;
  const base = `/api/runs/${parentPath(agent, name)}/${seg(runId)}`;
  crumbs.innerHTML = `/ <a href="/parents/${parentPath(agent, name)}">${esc(agent)}/${esc(name)}</a> / ${esc(runId)}`;
  main.innerHTML = `<h1>${esc(runId)}</h1>
    <div class="toolbar"><span class="notice" id="notice"></span></div>
    <section id="current"></section>
    <section class="inbox" id="inbox-section" hidden><h2>Waiting for you</h2><div id="inbox"></div></section>
    <section class="send" id="send-section" hidden><h2>Send a message</h2>
      <textarea id="send-text" rows="2" placeholder="What to tell the child: it takes it in at its next step"></textarea>
      <label><input type="checkbox" id="send-interrupt"> interrupt what it is doing now</label>
      <button class="send-message" data-send="1">Send</button></section>
    <h2>State as of a sequence</h2>
    <div class="slider"><input type="range" id="slider" min="0" max="0" step="1" value="0">
      <span id="slider-seq"></span></div>
    <div class="fork-here"><input type="text" id="fork-instructions"
      placeholder="instructions for the fork (optional; a model agent's)">
      <button class="fork" data-fork="1" title="a new run beside this one that reuses what it recorded up to this sequence">Fork here</button>
      <span id="forked"></span></div>
    <div class="as-of" id="as-of"></div>
    <h2>Steps</h2><div id="steps"></div><div id="usage" class="meta"></div>
    <h2>Events</h2><table id="events" class="events"><thead><tr><th>seq</th><th>type</th><th>at</th><th>data</th></tr></thead>
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
    if (run.resumable) actions.push(`<button class="rerequest" data-act="rerequest">Re-request</button>`);
    if (run.status === "error") actions.push(`<button class="rewind" data-act="rewind">Rewind</button>`);
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
    document.getElementById("send-section").hidden = run.finished || run.cancel_requested;
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

  async function forkHere(seq, instructions) {
    try {
      const answer = await api(`${base}/fork`, {method: "POST", body: JSON.stringify(
        instructions ? {seq, instructions} : {seq})});
      notice(answer.message);
      document.getElementById("forked").innerHTML =
        `<a class="fork-link" href="/runs/${parentPath(agent, name)}/${seg(answer.run_id)}">${esc(answer.run_id)}</a>
         · <a class="compare" href="/runs/${parentPath(agent, name)}/${seg(runId)}/diff/${seg(answer.run_id)}">compare</a>`;
    } catch (error) { notice(error.message, true); }
  }

  main.addEventListener("click", (click) => {
    const button = click.target.closest("button");
    if (!button) return;
    if (button.dataset.act) { button.disabled = true; act(`${base}/${button.dataset.act}`); return; }
    if (button.dataset.fork) {
      const box = document.getElementById("as-of");
      const instructions = document.getElementById("fork-instructions").value.trim();
      forkHere(Number(box.dataset.seq), instructions);
      return;
    }
    if (button.dataset.send) {
      const text = document.getElementById("send-text");
      if (!text.value.trim()) { notice("write the message first", true); return; }
      act(`${base}/send`, {text: text.value,
                           mode: document.getElementById("send-interrupt").checked ? "interrupt" : "queue"});
      text.value = "";
      return;
    }
    const item = button.closest(".item");
    if (!item) return;
    const path = `${item.dataset.base}/continue`;  // this run, or the paused one below it
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

  followRuns(agent, name, [runId], load);
  load();
}

// Reads a page's runs again whenever one of them changes: the parent's stream says when.
function followRuns(agent, name, runIds, load) {
  let pending = null;
  const source = new EventSource(`/api/parents/${parentPath(agent, name)}/stream`);
  const reload = () => { if (!pending) pending = setTimeout(() => { pending = null; load(); }, 100); };
  const ours = (id) => runIds.includes(id);
  source.addEventListener("snapshot", reload);
  source.addEventListener("update", (message) => {
    const data = JSON.parse(message.data);
    if (data.runs.some((r) => ours(r.run_id)) || data.removed.some(ours)) reload();
  });
}

// --- two runs side by side, from where they part ----------------------------------------

async function diffPage() {
  const {agent, name, run_id: runId, other} = props;
  const path = `/runs/${parentPath(agent, name)}`;
  crumbs.innerHTML = `/ <a href="/parents/${parentPath(agent, name)}">${esc(agent)}/${esc(name)}</a>
    / <a href="${path}/${seg(runId)}">${esc(runId)}</a> and <a href="${path}/${seg(other)}">${esc(other)}</a>`;
  main.innerHTML = `<h1>${esc(runId)} and ${esc(other)}</h1>
    <div class="toolbar"><span class="notice" id="notice"></span></div><div id="diff"></div>`;
  // A run still going (a fork just made) changes the comparison: it is read again then.
  followRuns(agent, name, [runId, other], () => showDiff(path, runId, other));
  await showDiff(path, runId, other);
}

async function showDiff(path, runId, other) {
  let compared;
  try { compared = await api(`/api${path}/${seg(runId)}/diff/${seg(other)}`); }
  catch (error) { notice(error.message, true); return; }
  const side = (run) => `<div class="side" data-run-id="${esc(run.run_id)}">
    <h2><a href="${path}/${seg(run.run_id)}">${esc(run.run_id)}</a></h2>
    <div class="meta"><span class="badge s-${esc(run.status)} status">${esc(run.status)}</span>
      <span>${run.steps} steps</span><span class="usage">${run.tokens} tokens · $${run.cost.toFixed(6)}</span>
      ${run.forked_from ? `<span>fork of ${esc(run.forked_from)} at sequence ${run.fork_seq}</span>` : ""}</div>
    ${run.summary ? `<div class="summary">${esc(run.summary)}</div>` : ""}
    ${run.error ? `<div class="problem">${esc(run.error)}</div>` : ""}
    <pre class="output">${esc(run.output_text || JSON.stringify(run.output ?? ""))}</pre></div>`;
  const step = (value) => value == null ? `<span class="empty">—</span>`
    : `<pre class="json">${esc(JSON.stringify(value, null, 2))}</pre>`;
  const parted = compared.diverged_at == null
    ? `the same for the first ${compared.shared} steps`
    : `the same for the first ${compared.shared} steps; they part at step ${compared.diverged_at}`;
  document.getElementById("diff").innerHTML = `<div class="sides">${side(compared.a)}${side(compared.b)}</div>
    <p class="parted" id="parted">${esc(parted)}</p>
    <table class="steps-diff"><thead><tr><th>step</th><th>${esc(compared.a.run_id)}</th><th>${esc(compared.b.run_id)}</th></tr></thead>
    <tbody>${compared.steps.map((pair) => `<tr data-index="${pair.index}" class="${pair.same ? "same" : "differs"}">
      <td>${pair.index}</td><td>${step(pair.a)}</td><td>${step(pair.b)}</td></tr>`).join("")}</tbody></table>`;
  document.body.dataset.loaded = "true";
}

function missingPage() {
  main.innerHTML = `<h1>Not found</h1><p class="empty">${esc(props.message || "")}</p>`;
}

({index: indexPage, parent: parentPage, run: runPage, diff: diffPage, missing: missingPage})[document.body.dataset.page]();
