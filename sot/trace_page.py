"""One self-contained HTML page for a step trace (``sot trace``).

The page embeds plotly.js and the trace data, so it opens offline and makes no network
request. It shows the answer token by token (coloured by how each token was committed), the
draft tree of any step (chosen with a slider or by clicking a token), the predicted states
against the target's (cosine and relative error by depth, and a PCA map of the states with
each step's predicted trajectory) and the step charts (acceptance by depth, the policy's
expected against committed tokens, the mode of each step, the time split).
"""
from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from sot.files import write_output
from sot.trace import TracedSequence


def _pca(actual: list[list[float]], predicted: list[list[float]]) -> tuple[list[list[float]], list[list[float]]]:
    """2-D principal-component coordinates of the actual states ``[N, D]`` and of predicted
    states projected on the same axes."""
    a = np.asarray(actual, dtype=np.float64)
    if a.shape[0] < 2:
        return [[0.0, 0.0] for _ in actual], [[0.0, 0.0] for _ in predicted]
    mean = a.mean(axis=0)
    _, _, vt = np.linalg.svd(a - mean, full_matrices=False)
    axes = vt[:2].T  # [D, 2]
    proj = lambda x: np.round((np.asarray(x, dtype=np.float64) - mean) @ axes, 4).tolist()  # noqa: E731
    return proj(a), (proj(predicted) if predicted else [])


def page_data(seq: TracedSequence) -> dict[str, Any]:
    """What the page's script draws for one sequence."""
    # the predicted vectors are drawn through their 2-D projections below, not sent whole
    steps = [{k: v for k, v in rec.items() if k != "predicted"} for rec in seq.steps]
    data: dict[str, Any] = {"index": seq.index, "pieces": seq.pieces, "steps": steps, "vocab": seq.vocab,
                            "tau": seq.tau, "text": seq.text, "states": None}
    if seq.states is not None:
        first = seq.states["positions"][0] if seq.states["positions"] else 0
        trajectories, flat = [], []
        for rec in seq.steps:
            vecs = [v for v in (rec.get("predicted") or []) if v is not None]
            if vecs:
                trajectories.append({"step": rec["step"], "start": rec["position"] - 1 - first, "n": len(vecs)})
                flat.extend(vecs)
        actual_2d, predicted_2d = _pca(seq.states["actual"], flat)
        at = 0
        for t in trajectories:
            t["points"] = predicted_2d[at : at + t["n"]]
            at += t["n"]
        data["states"] = {"compare": seq.states["compare"], "first": first, "actual2d": actual_2d,
                          "trajectories": trajectories}
    return data


_STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.3em; } h2 { font-size: 1.1em; margin-top: 1.4em; }
#tokens { line-height: 1.9; white-space: pre-wrap; font-family: ui-monospace, monospace; font-size: 0.92em;
          border: 1px solid #ddd; padding: 0.6em; border-radius: 4px; }
.tok { cursor: pointer; border-radius: 3px; padding: 1px 0; }
.tok.sel { outline: 2px solid #111; }
.tok.part { display: inline-block; min-width: 0.45em; height: 1.1em; vertical-align: middle; }
.tok .nl { color: #888; }
.legend span { display: inline-block; padding: 0 0.5em; margin-right: 0.4em; border-radius: 3px; font-size: 0.85em; }
.row { display: flex; flex-wrap: wrap; gap: 1em; } .row > div { flex: 1 1 420px; min-width: 380px; }
.muted { color: #666; font-size: 0.9em; }
"""

_SCRIPT = r"""
const DATA = JSON.parse(document.getElementById('trace-data').textContent);
const DEPTH_COLOURS = ['#1a9850', '#66bd63', '#a6d96a', '#fee08b'];  // depth 1, 2, 3, 4 and deeper
const STATE_COLOURS = ['#08519c', '#3182bd', '#6baed6', '#9ecae1', '#74c476', '#31a354', '#006d2c', '#fd8d3c'];
const KIND = {bonus: '#9ecae1', plain: '#e0e0e0', fallback: '#fcbba1', free: '#c6dbef'};
let seq = null, current = 0;

function tokText(id) { const t = seq.vocab[String(id)]; return t === undefined ? '#' + id : t; }
function fmt(x, d) { return x === null || x === undefined ? '-' : Number(x).toFixed(d); }
function plural(n, word) { return `${n} ${word}${n === 1 ? '' : 's'}`; }
// Plotly reads a few HTML tags in chart text (<b>, <br>, <a>, ...): token text is shown as written.
function esc(s) { return String(s).replace(/&/g, '&amp;').replace(/</g, '&lt;').replace(/>/g, '&gt;'); }

// One entry per answer token: the step that committed it and how.
function tokenKinds() {
  const out = [];
  seq.steps.forEach((st, k) => {
    const path = st.accepted.slice(1);
    for (let j = 0; j < st.committed; j++) {
      if (j < path.length) {
        const node = path[j];
        out.push({step: k, kind: 'depth', depth: j + 1, conf: st.confidences[node], prob: st.target_probs[node]});
      } else {
        const kind = st.mode === 'plain' || st.mode === 'fallback' ? st.mode : (st.mode === 'free' && st.tokens.length === 1 ? 'plain' : 'bonus');
        out.push({step: k, kind: kind, depth: 0, conf: null, prob: null});
      }
    }
  });
  return out;
}

function drawTokens() {
  const box = document.getElementById('tokens');
  box.textContent = '';
  const kinds = tokenKinds();
  seq.pieces.forEach((piece, i) => {
    const k = kinds[i] || {step: 0, kind: 'plain', depth: 0};
    const span = document.createElement('span');
    span.className = 'tok';
    span.dataset.step = k.step;
    if (piece === '') {  // part of a character that a later token completes
      span.classList.add('part');
    } else if (/^[\r\n]+$/.test(piece)) {  // a line break: a mark to see and click, then the break
      const mark = document.createElement('span');
      mark.className = 'nl';
      mark.textContent = '\u21b5';
      span.append(mark, piece);
    } else {
      span.textContent = piece;
    }
    span.style.background = k.kind === 'depth' ? DEPTH_COLOURS[Math.min(k.depth - 1, DEPTH_COLOURS.length - 1)] : KIND[k.kind];
    const st = seq.steps[k.step];
    span.title = (piece === '' ? 'part of a character the next token completes\n' : '') +
      `token ${i}: step ${k.step} (${st.mode}${st.probe ? ', probe' : ''}), tree ${st.tokens.length} nodes, ` +
      `${st.verified.filter(v => v).length} verified\n` +
      (k.kind === 'depth' ? `accepted at depth ${k.depth}, draft confidence ${fmt(k.conf, 3)}, ` +
                            `target probability ${fmt(k.prob, 3)} (the model's, before the request's rules)`
                          : (k.kind === 'bonus' ? 'bonus token (the target\'s own)' : `${k.kind} step`));
    span.addEventListener('click', () => selectStep(k.step));
    box.appendChild(span);
  });
}

function treeLayout(st) {
  const n = st.tokens.length, kids = Array.from({length: n}, () => []);
  for (let i = 1; i < n; i++) kids[st.parents[i]].push(i);
  const y = new Array(n).fill(0); let leaf = 0;
  (function place(i) {
    if (!kids[i].length) { y[i] = leaf++; return; }
    kids[i].forEach(place);
    y[i] = kids[i].reduce((s, c) => s + y[c], 0) / kids[i].length;
  })(0);
  const depth = new Array(n).fill(0);
  for (let i = 1; i < n; i++) depth[i] = depth[st.parents[i]] + 1;
  return {x: depth, y: y.map(v => -v), leaves: leaf};
}

function drawTree() {
  const st = seq.steps[current];
  const pos = treeLayout(st), onPath = new Set(st.accepted);
  const ex = [], ey = [];
  for (let i = 1; i < st.tokens.length; i++) {
    const p = st.parents[i];
    ex.push(pos.x[p], pos.x[i], null); ey.push(pos.y[p], pos.y[i], null);
  }
  const colour = st.tokens.map((_, i) => onPath.has(i) ? '#1a9850' : (st.verified[i] ? '#f46d43' : '#bdbdbd'));
  const labels = st.tokens.map((t, i) => esc(JSON.stringify(tokText(t))) + (i ? ' ' + fmt(st.confidences[i], 2) : ''));
  const hover = st.tokens.map((t, i) => `${esc(JSON.stringify(tokText(t)))} (token ${Number(t)})` +
    `<br>confidence ${fmt(st.confidences[i], 3)}` +
    `<br>target probability ${fmt(st.target_probs[i], 3)} (the model's, before the request's rules)<br>` +
    (onPath.has(i) ? 'accepted' : (st.verified[i] ? 'verified, rejected' : 'pruned by the policy')));
  Plotly.react('tree', [
    {x: ex, y: ey, mode: 'lines', line: {color: '#999', width: 1}, hoverinfo: 'skip', showlegend: false},
    {x: pos.x, y: pos.y, mode: 'markers+text', text: labels, textposition: 'middle right', hovertext: hover,
     hoverinfo: 'text', marker: {size: 13, color: colour, line: {width: 1, color: '#333'}}, showlegend: false},
  ], {title: {text: `step ${current}: ${esc(String(st.mode))}${st.probe ? ' (probe)' : ''}, ` +
                    `${plural(st.tokens.length, 'node')} proposed, ` +
                    `${st.verified.filter(v => v).length} verified, ${st.accepted.length - 1} accepted, expected ${fmt(st.expected, 2)}, committed ${st.committed}`,
              font: {size: 13}},
      xaxis: {title: {text: 'depth'}, dtick: 1, range: [-0.3, Math.max(...pos.x) + 1.2]},
      yaxis: {visible: false}, margin: {t: 40, l: 30, r: 10, b: 40},
      height: Math.max(360, 80 + 22 * pos.leaves)}, {displaylogo: false});  // a row of text per leaf
  document.getElementById('step-label').textContent = `step ${current} of ${seq.steps.length - 1}`;
  document.querySelectorAll('.tok').forEach(s => s.classList.toggle('sel', Number(s.dataset.step) === current));
}

function selectStep(k) {
  current = Math.max(0, Math.min(seq.steps.length - 1, k));
  document.getElementById('step').value = current;
  drawTree();
}

function drawStates() {
  const box = document.getElementById('states');
  if (!seq.states) { box.innerHTML = '<p class="muted">No predicted states: the state drafter did not draft this answer.</p>'; return; }
  box.innerHTML = '<div class="row"><div id="cosine"></div><div id="relerr"></div></div><div id="pca"></div>';
  const byDepth = {};
  seq.states.compare.forEach(c => { (byDepth[c.depth] = byDepth[c.depth] || []).push(c); });
  const series = key => Object.keys(byDepth).map(d => ({
    x: byDepth[d].map(c => c.position - seq.states.first), y: byDepth[d].map(c => c[key]), mode: 'markers',
    name: d === '0' ? 'root' : 'depth ' + d, marker: {size: 6, color: STATE_COLOURS[Math.min(Number(d), STATE_COLOURS.length - 1)]}}));
  const lay = (title, y) => ({title: {text: title, font: {size: 13}}, xaxis: {title: {text: 'answer token'}},
                              yaxis: {title: {text: y}}, height: 320, margin: {t: 40, l: 50, r: 10, b: 40}});
  Plotly.newPlot('cosine', series('cosine'), lay('predicted vs actual state: cosine', 'cosine'), {displaylogo: false});
  Plotly.newPlot('relerr', series('rel_error'), lay('predicted vs actual state: relative error', '|pred - actual| / |actual|'), {displaylogo: false});
  const a = seq.states.actual2d;
  const traces = [{x: a.map(p => p[0]), y: a.map(p => p[1]), mode: 'markers', name: 'target states (answer)',
                   marker: {size: 6, color: '#444'}, text: seq.pieces.map((t, i) => `token ${i}: ${esc(JSON.stringify(t))}`), hoverinfo: 'text'}];
  seq.states.trajectories.forEach((t, i) => {
    const xs = [], ys = [];
    if (t.start >= 0 && t.start < a.length) { xs.push(a[t.start][0]); ys.push(a[t.start][1]); }
    t.points.forEach(p => { xs.push(p[0]); ys.push(p[1]); });
    traces.push({x: xs, y: ys, mode: 'lines+markers', name: 'predicted', showlegend: i === 0, legendgroup: 'pred',
                 line: {color: '#d73027', width: 1}, marker: {size: 4, color: '#d73027'}, opacity: 0.45, hoverinfo: 'text',
                 text: xs.map(() => `step ${t.step}`)});
  });
  Plotly.newPlot('pca', traces, {title: {text: 'states in 2-D (PCA of the target\'s): each step\'s predicted trajectory from the state it started from', font: {size: 13}},
                                 height: 460, margin: {t: 40, l: 40, r: 10, b: 40}}, {displaylogo: false});
}

function drawSteps() {
  const att = [], acc = [];
  seq.steps.forEach(st => {
    const reach = st.accepted.length - 1;
    const depth = new Array(st.tokens.length).fill(0);
    for (let i = 1; i < st.tokens.length; i++) depth[i] = depth[st.parents[i]] + 1;
    const maxd = Math.max(0, ...depth.filter((d, i) => st.verified[i]));
    for (let d = 1; d <= maxd; d++) {
      if (reach >= d - 1) { att[d] = (att[d] || 0) + 1; if (reach >= d) acc[d] = (acc[d] || 0) + 1; }
    }
  });
  const depths = att.map((_, d) => d).filter(d => d > 0 && att[d]);
  // a chart's box holds either a chart or a note, as the shown answer has data for it
  const clear = id => { Plotly.purge(id); document.getElementById(id).textContent = ''; return id; };
  const none = (id, what) => { document.getElementById(clear(id)).innerHTML = `<p class="muted">${what}</p>`; };
  const lay = (title, x, y, h) => ({title: {text: title, font: {size: 13}}, xaxis: {title: {text: x}}, yaxis: {title: {text: y}},
                                    height: h || 300, margin: {t: 40, l: 50, r: 10, b: 40}});
  if (!depths.length) none('acceptance', 'Acceptance by depth: no step verified a drafted token.');
  else Plotly.newPlot(clear('acceptance'), [{x: depths, y: depths.map(d => (acc[d] || 0) / att[d]), type: 'bar', marker: {color: '#1a9850'},
    text: depths.map(d => `${acc[d] || 0}/${att[d]}`), hoverinfo: 'text+y'}], lay('acceptance by depth', 'depth', 'accepted / attempted'), {displaylogo: false});
  const withExp = seq.steps.filter(st => st.expected !== null);
  const top = Math.max(2, ...seq.steps.map(st => st.committed), ...withExp.map(st => st.expected));
  if (!withExp.length) none('calibration', 'Policy calibration: the policy estimated no step.');
  else Plotly.newPlot(clear('calibration'), [
    {x: withExp.map(st => st.expected), y: withExp.map(st => st.committed), mode: 'markers', name: 'steps',
     text: withExp.map(st => `step ${st.step}`), marker: {size: 7, color: '#3182bd', opacity: 0.6}},
    {x: [1, top], y: [1, top], mode: 'lines', name: 'expected = committed', line: {dash: 'dot', color: '#999'}}],
    lay('policy calibration: expected against committed tokens', 'expected tokens', 'committed tokens'), {displaylogo: false});
  const modes = ['draft', 'free', 'plain', 'fallback'], modeColour = {draft: '#1a9850', free: KIND.free, plain: '#bdbdbd', fallback: '#f46d43'};
  Plotly.newPlot('modes', modes.map(m => ({x: seq.steps.map((st, k) => st.mode === m ? k : null).filter(v => v !== null),
    y: seq.steps.filter(st => st.mode === m).map(st => st.committed), type: 'bar', name: m, marker: {color: modeColour[m]}})),
    Object.assign(lay('tokens committed per step, by mode (fallback intervals in red)', 'step', 'tokens'), {barmode: 'overlay'}), {displaylogo: false});
  const sum = key => seq.steps.reduce((s, st) => s + st[key], 0);
  Plotly.newPlot('times', [{labels: ['draft', 'verify', 'other'], values: [sum('draft_seconds'), sum('verify_seconds'), sum('other_seconds')],
    type: 'pie', marker: {colors: ['#fdae61', '#3182bd', '#bdbdbd']}, textinfo: 'label+percent',
    textposition: 'inside', sort: false}],
    {title: {text: 'time split of the steps', font: {size: 13}}, height: 300, margin: {t: 40, l: 10, r: 10, b: 10}}, {displaylogo: false});
}

function show(i) {
  seq = DATA.sequences[i];
  current = seq.steps.length > 1 ? 1 : 0;  // the first verify step (step 0 is the prompt's pass)
  const slider = document.getElementById('step');
  slider.max = Math.max(0, seq.steps.length - 1);
  slider.value = current;
  document.getElementById('summary').textContent =
    `${plural(seq.pieces.length, 'token')}: the prompt's pass and ${plural(Math.max(0, seq.steps.length - 1), 'step')}, ` +
    `mean accepted length ${Number(seq.tau).toFixed(2)}`;
  drawTokens(); drawTree(); drawStates(); drawSteps();
}

document.getElementById('step').addEventListener('input', e => selectStep(Number(e.target.value)));
const picker = document.getElementById('sequence');
DATA.sequences.forEach((s, i) => { const o = document.createElement('option'); o.value = i; o.textContent = `answer ${s.index}`; picker.appendChild(o); });
picker.addEventListener('change', e => show(Number(e.target.value)));
show(0);
"""


def _finite(x: Any) -> Any:
    """``x`` with every NaN or infinite float replaced by ``None`` (JSON has neither)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def embedded_json(data: Any) -> str:
    """``data`` as JSON that can sit inside a ``<script>`` element whatever its strings hold:
    ``<``, ``>`` and ``&`` are written as ``\\u`` escapes, so no text (``</script>``, or an
    answer that opens an HTML comment, ``<!--``, before a ``<script``) can end or change the
    element, and ``JSON.parse`` reads the same strings back."""
    text = json.dumps(_finite(data), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render_page(run: dict[str, Any], sequences: list[TracedSequence]) -> str:
    """The HTML text of the page."""
    from plotly.offline import get_plotlyjs

    payload = embedded_json({"run": run, "sequences": [page_data(s) for s in sequences]})
    title = f"SoT trace: {run.get('model', '?')}, drafter {run.get('drafter', '?')}, {run.get('dtype', '?')}"
    if run.get("request"):
        title += f", request {run['request']}"
    legend = "".join(
        f'<span style="background:{c}">{html.escape(n)}</span>'
        for n, c in [("accepted, depth 1", "#1a9850"), ("depth 2", "#66bd63"), ("depth 3", "#a6d96a"),
                     ("depth 4+", "#fee08b"), ("bonus (target's own)", "#9ecae1"), ("plain step", "#e0e0e0"),
                     ("fallback", "#fcbba1")]
    )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>{_STYLE}</style>
<script>{get_plotlyjs()}</script></head>
<body>
<h1>{html.escape(title)}</h1>
<p><label>Answer <select id="sequence"></select></label> <span id="summary" class="muted"></span></p>
<h2>The answer, token by token</h2>
<p class="legend">{legend}</p>
<div id="tokens"></div>
<h2>The draft tree of a step</h2>
<p><input type="range" id="step" min="0" max="0" value="0" style="width: 60%"> <span id="step-label" class="muted"></span>
<span class="muted">(or click a token; green: accepted path, red: verified and rejected, grey: pruned by the policy)</span></p>
<div id="tree"></div>
<h2>Predicted states against the target's</h2>
<div id="states"></div>
<h2>Steps</h2>
<div class="row"><div id="acceptance"></div><div id="calibration"></div></div>
<div class="row"><div id="modes"></div><div id="times"></div></div>
<script type="application/json" id="trace-data">{payload}</script>
<script>{_SCRIPT}</script>
</body></html>
"""


def write_page(path: str | Path, run: dict[str, Any], sequences: list[TracedSequence]) -> None:
    """Write the page for ``sequences`` to ``path`` (whole or not at all)."""
    page = render_page(run, sequences)
    write_output(path, lambda part: part.write_text(page, encoding="utf-8"))
