"use strict";
// The page at /: reads GET /info, then each section posts its form to the API (POST /embed, POST /nsp,
// POST /rerank) and draws the answer: on a canvas with the numbers in a table under it, or as bars with their
// numbers. No library: all of it ships in the package.

const POOLING_NOTES = {
  cls: "the [CLS] token's vector",
  pooled: "BERT's pooler: tanh(dense([CLS]))",
  mean: "the mean of the token vectors",
  max: "each dimension's maximum over the tokens",
  mean_sqrt_len: "the sum of the token vectors / √tokens",
  weightedmean: "a mean in which token i weighs i",
  lasttoken: "the final [SEP] token's vector",
};
// viridis: even steps of lightness, readable in grey and by most colour-blind readers
const VIRIDIS = [[68, 1, 84], [71, 44, 122], [59, 81, 139], [44, 113, 142], [33, 144, 141], [39, 173, 129],
  [92, 200, 99], [170, 220, 50], [253, 231, 37]];
const FONT = "12px system-ui, sans-serif";
const CELL_MIN = 10, CELL_MAX = 44, CELL_WITH_VALUE = 30;  // CSS pixels; values are written in cells this wide

let apiKey = "";  // in this tab's memory only, never stored
let info = null;  // GET /info

class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

async function api(path, body) {
  const init = {method: body === undefined ? "GET" : "POST", headers: {}};
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  if (apiKey) init.headers.Authorization = `Bearer ${apiKey}`;
  const request = new Request(path, init);  // a relative path: the API is where the page is
  let response;
  try {
    response = await fetch(request);
  } catch (e) {  // no answer at all, where the browser says only "Failed to fetch"
    throw new ApiError(0, `The server did not answer (stopped, or out of reach): ${e.message}`);
  }
  const data = await response.json().catch(() => null);
  if (!response.ok) {
    throw new ApiError(response.status, data && data.error ? data.error.message : `${path} answered ${response.status}`);
  }
  return data;
}

// ---- numbers

/** base64 little-endian float32, `n` rows -> n Float64Arrays */
function vectors(base64, n) {
  const bytes = Uint8Array.from(atob(base64), (c) => c.charCodeAt(0));
  const view = new DataView(bytes.buffer), width = bytes.length / 4 / n;
  return Array.from({length: n}, (_, i) =>
    Float64Array.from({length: width}, (_, k) => view.getFloat32(4 * (i * width + k), true)));
}

function cosine(u, v) {
  let dot = 0, uu = 0, vv = 0;
  for (let k = 0; k < u.length; k++) {
    dot += u[k] * v[k];
    uu += u[k] * u[k];
    vv += v[k] * v[k];
  }
  return uu && vv ? dot / Math.sqrt(uu * vv) : 0;
}

const cosines = (rows, cols) => rows.map((u) => cols.map((v) => cosine(u, v)));

function range(matrices) {
  // a loop, not Math.min(...values): two 512-token texts make 262,144 arguments, past the call stack
  let lo = Infinity, hi = -Infinity;
  for (const value of matrices.flat(2)) {
    lo = Math.min(lo, value);
    hi = Math.max(hi, value);
  }
  return {lo, hi};
}

function colour(value, {lo, hi}) {
  const t = hi > lo ? Math.min(1, Math.max(0, (value - lo) / (hi - lo))) : 0.5;
  const x = t * (VIRIDIS.length - 1), i = Math.min(Math.floor(x), VIRIDIS.length - 2), f = x - i;
  return VIRIDIS[i].map((c, k) => Math.round(c + f * (VIRIDIS[i + 1][k] - c)));
}

const css = (rgb) => `rgb(${rgb.join(",")})`;
const light = ([r, g, b]) => 0.299 * r + 0.587 * g + 0.114 * b > 140;

// ---- drawing

const clip = (text) => (text.length > 14 ? `${text.slice(0, 13)}…` : text);

/** Draws `matrix` (rows x cols) as coloured cells with their labels; labels are {text, muted}. The cells'
 *  geometry is kept on the canvas (data-x0, data-y0, data-cell, CSS pixels) for the tooltip and tests. */
function drawHeatmap(canvas, matrix, rowLabels, colLabels, scale, marked, maxWidth) {
  const ctx = canvas.getContext("2d");
  ctx.font = FONT;
  const widest = (labels) => Math.max(...labels.map((l) => ctx.measureText(clip(l.text)).width));
  const rows = matrix.length, cols = matrix[0].length;
  const x0 = Math.ceil(widest(rowLabels) + 10);
  const cell = Math.max(CELL_MIN, Math.min(CELL_MAX, Math.floor((maxWidth - x0 - 2) / cols)));
  const rotate = widest(colLabels) > cell - 4;
  const y0 = Math.ceil(rotate ? widest(colLabels) + 10 : 20);
  const width = x0 + cols * cell + 2, height = y0 + rows * cell + 2, dpr = window.devicePixelRatio || 1;
  canvas.width = Math.round(width * dpr);  // resizing resets the context
  canvas.height = Math.round(height * dpr);
  canvas.style.width = `${width}px`;
  canvas.style.height = `${height}px`;
  Object.assign(canvas.dataset, {rows, cols, x0, y0, cell});
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.textBaseline = "middle";

  for (let i = 0; i < rows; i++) {
    for (let j = 0; j < cols; j++) {
      const rgb = colour(matrix[i][j], scale), x = x0 + j * cell, y = y0 + i * cell;
      ctx.fillStyle = css(rgb);
      ctx.fillRect(x, y, cell, cell);
      if (cell >= CELL_WITH_VALUE) {
        ctx.font = "11px system-ui, sans-serif";
        ctx.textAlign = "center";
        ctx.fillStyle = light(rgb) ? "#000" : "#fff";
        ctx.fillText(matrix[i][j].toFixed(2), x + cell / 2, y + cell / 2);
      }
      if (marked(i, j)) {
        ctx.strokeStyle = "#e8002a";
        ctx.lineWidth = 2.5;
        ctx.strokeRect(x + 1.5, y + 1.5, cell - 3, cell - 3);
      }
    }
  }
  ctx.font = FONT;
  rowLabels.forEach((label, i) => {
    ctx.textAlign = "right";
    ctx.fillStyle = label.muted ? "#888" : "#111";
    ctx.fillText(clip(label.text), x0 - 6, y0 + i * cell + cell / 2);
  });
  colLabels.forEach((label, j) => {
    ctx.fillStyle = label.muted ? "#888" : "#111";
    ctx.save();
    ctx.translate(x0 + j * cell + cell / 2, y0 - 6);
    if (rotate) {
      ctx.rotate(-Math.PI / 2);
      ctx.textAlign = "left";
    } else {
      ctx.textAlign = "center";
      ctx.textBaseline = "bottom";
    }
    ctx.fillText(clip(label.text), 0, 0);
    ctx.restore();
  });
}

function element(tag, properties = {}, ...children) {
  const node = Object.assign(document.createElement(tag), properties);
  node.append(...children);
  return node;
}

function table(matrix, rowLabels, colLabels, name) {
  const head = element("tr", {}, element("th"), ...colLabels.map((l) => element("th", {scope: "col"}, l.text)));
  const body = matrix.map((row, i) => element("tr", {}, element("th", {scope: "row"}, rowLabels[i].text),
    ...row.map((v) => element("td", {}, v.toFixed(3)))));
  const summary = element("summary", {}, "The numbers");
  if (name) summary.setAttribute("aria-label", `The numbers: ${name}`);  // one name each, for a screen reader
  return element("details", {}, summary,
    element("table", {}, element("thead", {}, head), element("tbody", {}, ...body)));
}

function legend({lo, hi}) {
  const stops = VIRIDIS.map((c, i) => `${css(c)} ${(100 * i / (VIRIDIS.length - 1)).toFixed(1)}%`).join(", ");
  return element("div", {className: "legend"}, element("span", {}, lo.toFixed(2)),
    element("span", {className: "ramp", style: `background: linear-gradient(to right, ${stops})`}),
    element("span", {}, `${hi.toFixed(2)} cosine`));
}

/** A figure: the heatmap (with a tooltip), and the numbers in a table. */
function heatmap(matrix, rowLabels, colLabels, scale, {caption = null, marked = () => false, maxWidth, describe}) {
  const canvas = element("canvas", {className: "heatmap"});
  canvas.setAttribute("role", "img");
  canvas.setAttribute("aria-label", "cosine similarities as colours; the numbers are in the table below");
  const parts = caption ? [caption] : [];
  const node = element("figure", {}, ...parts, canvas, table(matrix, rowLabels, colLabels, caption && caption.textContent));
  drawHeatmap(canvas, matrix, rowLabels, colLabels, scale, marked, maxWidth);
  const tooltip = document.getElementById("tooltip");
  canvas.addEventListener("mousemove", (event) => {
    const {x0, y0, cell} = canvas.dataset, rect = canvas.getBoundingClientRect();
    const j = Math.floor((event.clientX - rect.left - x0) / cell), i = Math.floor((event.clientY - rect.top - y0) / cell);
    if (i < 0 || j < 0 || i >= matrix.length || j >= matrix[0].length) {
      tooltip.hidden = true;
      return;
    }
    tooltip.textContent = `${describe(i, j)}: cosine ${matrix[i][j].toFixed(3)}`;
    Object.assign(tooltip.style, {left: `${event.pageX + 14}px`, top: `${event.pageY + 14}px`});
    tooltip.hidden = false;
  });
  canvas.addEventListener("mouseleave", () => { tooltip.hidden = true; });
  return node;
}

const widthOf = (node) => Math.max(240, node.clientWidth);

// ---- the sections

async function compareTokens() {
  const a = field("sentence-a"), b = field("sentence-b");
  if (!a || !b) throw new Error("Type a sentence in both fields.");
  const body = await api("embed", {inputs: [a, b], pooling: "none", return_tokens: true, encoding_format: "base64"});
  const [A, B] = body.data.map((item) => ({tokens: item.tokens,
    labels: item.tokens.map((t) => ({text: t.token, muted: t.special})),
    vectors: vectors(item.token_embeddings, item.tokens.length)}));
  const matrix = cosines(A.vectors, B.vectors);
  const same = (i, j) => !A.tokens[i].special && A.tokens[i].token === B.tokens[j].token;
  return (out) => {
    const pairs = [];
    matrix.forEach((row, i) => row.forEach((v, j) => { if (same(i, j)) pairs.push(`“${A.tokens[i].token}” ${v.toFixed(3)}`); }));
    const more = pairs.length > 12 ? ` and ${pairs.length - 12} more` : "";
    const summary = pairs.length
      ? `The same token in both sentences: ${pairs.slice(0, 12).join(", ")}${more}.`
      : "No token appears in both sentences: try one word in two meanings.";
    const scale = range([matrix]);
    out.replaceChildren(legend(scale), heatmap(matrix, A.labels, B.labels, scale, {marked: same, maxWidth: widthOf(out),
      describe: (i, j) => `A “${A.tokens[i].token}” × B “${B.tokens[j].token}”`}), element("p", {className: "summary"}, summary));
    out.dataset.inputs = JSON.stringify([a, b]);
  };
}

async function compareTexts() {
  const texts = field("texts-input").split("\n").map((t) => t.trim()).filter(Boolean);
  const most = Math.min(info.limits.max_inputs_per_request, 16);  // more would not fit a readable matrix
  if (texts.length < 2 || texts.length > most) throw new Error(`Type from 2 to ${most} texts, one per line.`);
  const poolings = info.poolings.filter((p) => p !== "none");  // "none": tokens only, no text vector
  const matrices = [];
  for (const pooling of poolings) {  // one after another: the server's concurrency limit is for everyone
    const body = await api("embed", {inputs: texts, pooling, encoding_format: "base64"});
    const v = body.data.map((item) => vectors(item.embedding, 1)[0]);
    matrices.push(cosines(v, v));
  }
  return (out) => {
    const labels = texts.map((_, i) => ({text: String(i + 1)}));
    const scale = range(matrices);
    const width = Math.min(360, widthOf(out));
    document.getElementById("texts-legend").replaceChildren(...texts.map((t) => element("li", {}, t)));
    out.replaceChildren(legend(scale), ...poolings.map((pooling, k) => {
      const caption = element("figcaption", {}, element("strong", {}, pooling),
        pooling === info.default_pooling ? element("span", {className: "badge"}, "default") : "",
        element("br"), POOLING_NOTES[pooling] || "");
      const figure = heatmap(matrices[k], labels, labels, scale, {caption, maxWidth: width,
        describe: (i, j) => `${pooling}: text ${i + 1} × text ${j + 1}`});
      figure.dataset.pooling = pooling;
      return figure;
    }));
    out.dataset.inputs = JSON.stringify(texts);
  };
}

async function scorePair() {
  const a = field("nsp-a"), b = field("nsp-b");
  if (!a || !b) throw new Error("Type a sentence in both fields.");
  const body = await api("nsp", {pairs: [[a, b], [b, a]]});
  return (out) => {
    out.replaceChildren(...body.data.map((item, k) => {
      const percent = (100 * item.is_next).toFixed(1);
      const row = element("div", {className: "nsp-row"},
        element("span", {className: "order"}, k === 0 ? "A, then B" : "B, then A"),
        element("span", {className: "bar"}, element("span", {style: `width: ${percent}%`})),
        element("span", {className: "score"}, `${percent} % that the second follows the first`),
        element("span", {className: "logits"}, `logits [is next, not next]: ${item.logits.map((x) => x.toFixed(3)).join(", ")}`));
      row.dataset.isNext = item.is_next;
      return row;
    }));
    out.dataset.inputs = JSON.stringify([a, b]);
  };
}

const MOST_TO_RANK = 32;  // more would not fit the section

async function rankTexts() {
  const query = field("rerank-query");
  const texts = field("rerank-texts").split("\n").map((t) => t.trim()).filter(Boolean);
  const most = Math.min(info.limits.max_inputs_per_request, MOST_TO_RANK);
  if (!query) throw new Error("Type a query.");
  if (texts.length < 1 || texts.length > most) throw new Error(`Type from 1 to ${most} texts, one per line.`);
  const ranks = await api("rerank", {query, texts});  // [{index, score}], most relevant first
  return (out) => {
    out.replaceChildren(...ranks.map(({index, score}) => {
      const item = element("li", {}, element("div", {className: "rank"},
        element("span", {className: "bar"}, element("span", {style: `width: ${(100 * score).toFixed(1)}%`})),
        element("span", {className: "score"}, score.toFixed(3)),
        element("span", {className: "text"}, texts[index])));
      Object.assign(item.dataset, {index, score});
      return item;
    }));
    out.dataset.inputs = JSON.stringify([query, ...texts]);
  };
}

/** Why the model cannot rank, or null when it can (a cross-encoder: a classifier head with one label). */
function cannotRank(labels) {
  if (labels.length === 1) return null;
  if (labels.length === 0) {
    return "This model has no cross-encoder head: ranking needs a model fine-tuned to score (query, text) " +
      "pairs, such as a sentence-transformers CrossEncoder, exported as it is. The sections above do not need it.";
  }
  return `This model classifies into ${labels.length} labels (${labels.join(", ")}), it is not a ` +
    "cross-encoder with one score: POST /predict gives each label's score.";
}

// ---- wiring

const field = (id) => document.getElementById(id).value.trim();

function status(message, isError = false) {
  const node = document.getElementById("status");
  node.textContent = message;
  node.classList.toggle("error", isError);
}

function askForKey(message) {
  status(apiKey ? `The key was refused: ${message}` : "This server needs an API key: type it above.", true);
  document.getElementById("api-key").focus();
}

/** Wires a section's form to `compute` (fetches, then returns a function that draws into the section's
 *  output); only the latest run's answer is drawn. Returns the function that runs it. */
function section(id, compute) {
  const node = document.getElementById(id), error = node.querySelector(".error");
  const out = node.querySelector(".output");
  let latest = 0;
  async function run() {
    const ticket = ++latest;
    error.hidden = true;
    node.setAttribute("aria-busy", "true");
    try {
      const draw = await compute();
      if (ticket === latest) draw(out);
    } catch (e) {
      if (ticket !== latest) return;
      error.textContent = e.message;
      error.hidden = false;
      if (e.status === 401) askForKey(e.message);
    } finally {
      if (ticket === latest) node.removeAttribute("aria-busy");
    }
  }
  node.querySelector("form").addEventListener("submit", (event) => {
    event.preventDefault();
    run();
  });
  return run;
}

const runs = {tokens: section("tokens", compareTokens), texts: section("texts", compareTexts),
  nsp: section("nsp", scorePair), rerank: section("rerank", rankTexts)};

async function start() {
  status("Asking the server which model it serves…");
  try {
    info = await api("info");
  } catch (e) {
    if (e.status === 401) {
      askForKey(e.message);
    } else if (e.status === 503) {  // no model loaded (yet)
      status(`${e.message} Trying again…`);
      setTimeout(start, 2000);
    } else {
      status(e.message, true);
    }
    return;
  }
  status("");
  const model = document.getElementById("model");
  model.textContent = `${info.model}: ${info.num_layers} layers, ${info.num_heads} heads, ` +
    `${info.dimensions} dimensions, up to ${info.max_length} tokens a text; ${info.precision} on ${info.device}.`;
  document.getElementById("nsp-missing").hidden = info.has_nsp_head;
  document.getElementById("nsp-form").hidden = !info.has_nsp_head;
  const noRanking = cannotRank(info.classifier_labels);
  document.getElementById("rerank-missing").textContent = noRanking || "";
  document.getElementById("rerank-missing").hidden = !noRanking;
  document.getElementById("rerank-form").hidden = Boolean(noRanking);
  if (!noRanking) model.append(" A cross-encoder: ", element("a", {href: "#rerank"}, "it ranks texts against a query"), ".");
  for (const button of document.querySelectorAll("main button")) button.disabled = false;
  // one section after another, as compareTexts' requests go: the server may serve only one request at once
  await runs.tokens();
  await runs.texts();
  if (info.has_nsp_head) await runs.nsp();
  if (!noRanking) await runs.rerank();
}

document.getElementById("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  apiKey = document.getElementById("api-key").value.trim();
  start();
});
start();
