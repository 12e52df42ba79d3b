// tether ui: what every page draws with: helpers, a run's card, the inbox, steps.
"use strict";

const STATUSES = ["starting", "running", "completed", "error", "aborted", "interrupted"];

function esc(value) {
  return String(value ?? "").replace(/[&<>"']/g, (c) => ({
    "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));
}
const seg = encodeURIComponent;
function parentPath(agent, name) { return `${seg(agent)}/${seg(name)}`; }
function clock(ms) { return ms == null ? "—" : new Date(ms).toISOString().slice(11, 23); }
// A duration as people read it: 850 ms, 4.2 s, 3 min 20 s, 1 h 5 min, 2 h, 24 h.
function span(ms) {
  if (ms == null) return "—";
  const sign = ms < 0 ? "-" : "", abs = Math.abs(ms);
  if (abs < 1000) return `${sign}${Math.round(abs)} ms`;
  if (abs < 59_950) return `${sign}${(abs / 1000).toFixed(1)} s`;
  if (abs < 3_599_500) {
    const seconds = Math.round(abs / 1000);
    return `${sign}${Math.floor(seconds / 60)} min${seconds % 60 ? ` ${seconds % 60} s` : ""}`;
  }
  const minutes = Math.round(abs / 60_000);
  return `${sign}${Math.floor(minutes / 60)} h${minutes % 60 ? ` ${minutes % 60} min` : ""}`;
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
  // A completed run is all done, whatever fraction its child last reported.
  const fraction = run.status === "completed" ? 1 : p.fraction ?? null;
  const percent = fraction == null ? null : Math.round(100 * fraction);
  const runUrl = `/runs/${parentPath(run.parent.agent, run.parent.name)}/${seg(run.run_id)}`;
  const actions = [];
  if (!run.finished) actions.push(`<button class="cancel danger" data-act="cancel">Cancel</button>`);
  if (run.resumable) {
    actions.push(`<button class="rerequest" data-act="rerequest">Re-request</button>`);
  }
  if (run.status === "error") {
    actions.push(`<button class="rewind" data-act="rewind" title="take it up again from its last recorded step">Rewind</button>`);
  }
  const pins = run.milestones.map((m) =>
    `<span class="pin" data-sequence="${m.sequence}" title="${esc(clock(m.at))}">${esc(m.name)}</span>`).join("");
  const children = tree.childrenOf(run);
  const meta = [
    `attempt ${run.attempt}`,
    run.agent_version ? `<span class="version">version ${esc(run.agent_version)}</span>` : "",
    run.detached ? "detached" : "awaited",
    `requested ${clock(run.requested_at)}`,
    run.waiting_for ? `waiting: ${esc(run.waiting_for)}` : "",
    run.cancel_requested && !run.finished ? "cancel requested" : "",
    run.reattach_attempts ? `re-attach ${run.reattach_attempts}` : "",
    budgetText(run.budget),
    run.turn > 1 ? `<span class="turn">turn ${run.turn}</span>` : "",
    run.forked_from ? forkText(run) : "",
    run.rewinds ? `<span class="rewinds">rewound ${run.rewinds}×</span>` : "",
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
    <div class="bar" data-fraction="${fraction ?? ""}" role="progressbar" aria-valuemin="0"
      aria-valuemax="100" ${percent == null ? "" : `aria-valuenow="${percent}"`}><div class="fill"
      style="width:${fraction == null ? 0 : (100 * fraction).toFixed(1)}%"></div></div>
    <div class="meta">${percent == null ? "" : `<span class="percent">${percent} %</span>`}
      ${p.phase ? `<span class="phase">${esc(p.phase)}</span>` : ""}
      ${p.message ? `<span class="message">${esc(p.message)}</span>` : ""}${meta.map((m) => `<span>${m}</span>`).join("")}</div>
    ${waitingPath(run, tree)}
    ${pins ? `<div class="pins">${pins}</div>` : ""}
    ${turnsBlock(run)}
    ${messagesBlock(run)}
    ${run.output_text ? `<pre class="output">${run.output_truncated ? "…" : ""}${esc(run.output_text)}</pre>` : ""}
    ${run.summary ? `<div class="summary">${esc(run.summary)}</div>` : ""}
    ${run.error ? `<div class="problem">${esc(run.error)}</div>` : ""}
    ${run.status === "interrupted" ? `<div class="reason">reason: ${esc(run.reason)}
      · child still running: ${run.child_still_running == null ? "unknown" : run.child_still_running}</div>` : ""}
    ${waterfall(run)}
    ${children.length ? `<div class="children">${children.map((c) => runCard(c, tree, {actions: false})).join("")}</div>` : ""}
  </div>`;
}

// A fork: the run it was taken from and where, and the comparison of the two.
function forkText(run) {
  const path = `/runs/${parentPath(run.parent.agent, run.parent.name)}`;
  return `<span class="fork">fork of <a href="${path}/${seg(run.forked_from)}">${esc(run.forked_from)}</a>
    at ${esc(run.fork_at)} · <a class="compare" href="${path}/${seg(run.forked_from)}/diff/${seg(run.run_id)}">compare</a></span>`;
}

// Its budget over it and the runs below it: spent of the limit, reserved by open runs
// below it, left.
function budgetText(budget) {
  if (!budget) return "";
  const parts = [];
  if (budget.max_tokens != null) {
    parts.push(`<span class="budget" data-left-tokens="${budget.left_tokens}">tokens ${budget.spent_tokens.toLocaleString("en")} of ${budget.max_tokens.toLocaleString("en")} · ${budget.reserved_tokens.toLocaleString("en")} reserved · ${Math.max(budget.left_tokens, 0).toLocaleString("en")} left</span>`);
  }
  if (budget.max_cost != null) {
    parts.push(`<span class="budget">cost $${budget.spent_cost.toFixed(4)} of $${budget.max_cost.toFixed(4)} · $${budget.reserved_cost.toFixed(4)} reserved · $${Math.max(budget.left_cost, 0).toFixed(4)} left</span>`);
  }
  return parts.join(" ");
}

// The turns a run took before its current one (follow-ups), in order, each with its
// outcome.
function turnsBlock(run) {
  if (!run.turns || !run.turns.length) return "";
  const rows = run.turns.map((t) => `<li class="turn" data-turn="${t.turn}" data-status="${esc(t.status)}">
      <span class="badge s-${esc(t.status)}">turn ${t.turn}: ${esc(t.status)}</span>
      ${esc(t.summary || t.error || "")}
      <span class="meta">${esc(clock(t.requested_at))} → ${esc(clock(t.ended_at))}${t.tokens ? ` · ${t.tokens.toLocaleString("en")} tokens` : ""}</span></li>`).join("");
  return `<ol class="turns">${rows}</ol>`;
}

// The parent's steering messages to the run, each with how far it got: sent, handed to
// the child, taken in.
function messagesBlock(run) {
  if (!run.messages || !run.messages.length) return "";
  const rows = run.messages.map((m) => {
    const said = m.text ?? "";
    const data = m.data == null ? "" : ` <code>${esc(JSON.stringify(m.data))}</code>`;
    const stage = m.consumed_at != null ? `taken in ${clock(m.consumed_at)}`
      : m.delivered_at != null ? `delivered ${clock(m.delivered_at)}` : "waiting";
    return `<li class="steer" data-message-id="${esc(m.message_id)}" data-stage="${
      m.consumed_at != null ? "consumed" : m.delivered_at != null ? "delivered" : "sent"}">
      <span class="mode">${esc(m.mode)}</span> ${esc(said)}${data}
      <span class="meta">sent ${esc(clock(m.sent_at))} · ${esc(stage)}</span></li>`;
  }).join("");
  return `<ul class="messages">${rows}</ul>`;
}

// A run that waits because a run below it does: the runs down to the paused one, each a
// link to its page (`waiting_path`: {agent, name, run_id} of each, its owner and its id).
function waitingPath(run, tree) {
  const path = run.waiting_path || [];
  if (!path.length) return "";
  const hops = path.map((hop) => {
    const known = tree.nested.get(`${hop.agent}/${hop.name}/${hop.run_id}`);
    const label = `${known ? known.display || known.agent_type : hop.agent + "/" + hop.name} ${hop.run_id}`;
    return `<a class="hop" href="/runs/${parentPath(hop.agent, hop.name)}/${seg(hop.run_id)}"
      title="${esc(hop.agent)}/${esc(hop.name)}">${esc(label)}</a>`;
  });
  return `<div class="waiting-path" data-depth="${path.length}">waits below: ${hops.join(" → ")}</div>`;
}

// What an inbox item answers: the run itself, or the paused run at the end of its
// `waiting_path` (its pending calls, once the page has it among the nested runs).
function waitingTarget(run, tree) {
  const path = run.waiting_path || [];
  if (!path.length) {
    return {base: `/api/runs/${parentPath(run.parent.agent, run.parent.name)}/${seg(run.run_id)}`,
            pending: run.pending};
  }
  const last = path[path.length - 1];
  const paused = tree && tree.nested.get(`${last.agent}/${last.name}/${last.run_id}`);
  return {base: `/api/runs/${parentPath(last.agent, last.name)}/${seg(last.run_id)}`,
          pending: paused && paused.waiting_for ? paused.pending : [], below: paused};
}

function byOrder(a, b) {
  const ao = a.display_order ?? Infinity, bo = b.display_order ?? Infinity;
  return ao - bo || a.requested_at - b.requested_at || (a.run_id < b.run_id ? -1 : 1);
}

// Runs of the page and their nested runs (each owned by its run's `as_parent`).
class Tree {
  constructor() { this.runs = new Map(); this.nested = new Map(); }
  key(run) { return `${run.parent.agent}/${run.parent.name}/${run.run_id}`; }
  childrenOf(run) {
    const owner = `${run.as_parent.agent}/${run.as_parent.name}/`;
    return [...this.nested.values()].filter((c) => `${c.parent.agent}/${c.parent.name}/` === owner)
      .sort(byOrder);
  }
  rootOf(nested) {
    let current = nested;
    for (let depth = 0; depth < 8; depth += 1) {
      const owner = [...this.runs.values(), ...this.nested.values()].find(
        (r) => r.as_parent.agent === current.parent.agent && r.as_parent.name === current.parent.name);
      if (!owner) return null;
      if (this.runs.get(owner.run_id) === owner) return owner.run_id;
      current = owner;
    }
    return null;
  }
}

// --- a run waiting for a human, as the inbox shows it -----------------------------------

function inboxItem(run, tree) {
  const {base, pending: calls, below} = waitingTarget(run, tree);
  const pending = calls.map((call) => `<div class="pending" data-call="${esc(call.tool_call_id)}">
      <b>${esc(call.tool_name)}</b> <code>${esc(JSON.stringify(call.input))}</code>
      <span class="meta">${esc(call.reason)}</span>
      ${call.reason === "approval" ? `<button class="approve primary" data-call="${esc(call.tool_call_id)}">Approve</button>
        <button class="reject danger" data-call="${esc(call.tool_call_id)}">Reject</button>`
        : `<input type="text" class="tool-output" placeholder='tool output as JSON, e.g. {"ok": true}'>
        <button class="give-output" data-call="${esc(call.tool_call_id)}">Give output</button>`}
    </div>`).join("");
  return `<div class="item" data-run-id="${esc(run.run_id)}" data-base="${esc(base)}">
    <div><b>${esc(run.display || run.agent_type)}</b> <span class="id">${esc(run.run_id)}</span>
      waits: ${esc(run.waiting_for)}${below ? ` (${esc(below.display || below.agent_type)}
      <span class="id">${esc(below.run_id)}</span> below)` : ""}</div>
    ${pending}
    <textarea class="human-input" placeholder="Your answer (human input)"></textarea>
    <button class="continue">Continue</button>
  </div>`;
}

// --- a run's detail -------------------------------------------------------------------

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
