"""The HTML report's inline CSS, SVG patterns and script (auditor.report.html).

The script reads the JSON blob `#numaudit-data` and builds the page with `textContent` and
attributes only (no `innerHTML`), so strings from runs are never parsed as markup. Filters, the
selected finding and the sort order live in the URL's fragment (`#verdict=diverged&site=moe`), so
a link (or a headless browser) opens the page in that state.
"""

CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#222;background:#fafafa}
main{max-width:1400px;margin:0 auto;padding:12px 20px}
h1{font-size:20px;margin:8px 0}h2{font-size:17px;margin:18px 0 6px;border-bottom:1px solid #ccc}
h3{font-size:15px;margin:10px 0 4px}
.ok{color:#1a7f37;font-weight:600}.bad{color:#b2182b;font-weight:600}
.box{background:#fff;border:1px solid #ddd;border-radius:4px;padding:8px 12px;margin:6px 0}
#first.bad-box{border-left:5px solid #b2182b}
.muted{color:#666}.mono{font-family:ui-monospace,monospace;font-size:12px}
a.link{color:#0550ae;cursor:pointer;text-decoration:underline;margin-right:10px}
details.hm-phase{margin:6px 0}details.hm-phase summary{cursor:pointer;font-size:15px}
.hm{overflow-x:auto}.hm svg{display:block}
.hm text{font:10px ui-monospace,monospace;fill:#333}
rect.cell{stroke:#fff;stroke-width:.5;cursor:pointer}
.mark{pointer-events:none}
rect.first-mark{fill:none;stroke:#000;stroke-width:3;pointer-events:none}
rect.sel-mark{fill:none;stroke:#0550ae;stroke-width:2;stroke-dasharray:3 2;pointer-events:none}
.legend{display:flex;gap:14px;align-items:center;flex-wrap:wrap;margin:4px 0}
.legend svg{vertical-align:middle}
table{border-collapse:collapse;width:100%;background:#fff;font-size:12px}
th,td{border:1px solid #ddd;padding:2px 5px;text-align:left;vertical-align:top}
th{background:#f0f0f0;cursor:pointer;user-select:none;white-space:nowrap}
tr.finding{cursor:pointer}tr.finding:hover{background:#f3f7ff}
tr.breach td.verdict{color:#b2182b;font-weight:600}
tr.breach td.verdict::before{content:"\\2716 "}
tr.selected{background:#dbe9ff !important}
.filters{display:flex;gap:10px;flex-wrap:wrap;align-items:center;margin:6px 0}
.ranks{display:flex;flex-wrap:wrap;gap:2px;margin:2px 0 8px}
.rk{width:22px;height:18px;border:1px solid #999;font:10px ui-monospace,monospace;
 text-align:center;line-height:18px;background:#fff;color:#999}
.rk.held{background:#cfe3ff;color:#000}
.rk.differ{background:#b2182b;color:#fff;border:2px solid #000;line-height:14px}
td.o,td.step,td.mb,td.stage,td.measure,td.threshold,td.verdict,td.group{white-space:nowrap}
.hm text.axis{font:bold 11px system-ui,sans-serif;fill:#444}
.hm line.tick{stroke:#bbb;stroke-width:1}
#groups li{margin:4px 0}#groups .keys{font-family:ui-monospace,monospace;font-size:12px}
"""

SVG_DEFS = (
    '<svg width="0" height="0" style="position:absolute" aria-hidden="true"><defs>'
    '<pattern id="na-dots" width="4" height="4" patternUnits="userSpaceOnUse">'
    '<circle cx="2" cy="2" r="0.9" fill="#000" fill-opacity="0.55"/></pattern>'
    '<pattern id="na-hatch" width="5" height="5" patternUnits="userSpaceOnUse" '
    'patternTransform="rotate(45)"><rect width="2" height="5" fill="#000" fill-opacity="0.6"/>'
    '</pattern></defs></svg>'
)

JS = r"""
'use strict';
(function () {
const D = JSON.parse(document.getElementById('numaudit-data').textContent);
const NS = 'http://www.w3.org/2000/svg';
const app = document.getElementById('app');
app.textContent = '';
function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === 'onclick') e.addEventListener('click', v); else e.setAttribute(k, v);
  }
  for (const k of kids) e.append(k instanceof Node ? k : document.createTextNode(String(k)));
  return e;
}
function sv(tag, attrs) {
  const e = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  return e;
}
function fmt(v) {
  if (v === null || v === undefined) return '-';
  if (typeof v === 'string') return v;
  if (v === 0) return '0';
  const a = Math.abs(v);
  return (a >= 0.01 && a < 1000) ? v.toFixed(3).replace(/\.?0+$/, '') : v.toExponential(2);
}
function plural(n, one, many) { return n + ' ' + (n === 1 ? one : (many || one + 's')); }
function ranges(xs) {
  const out = []; let i = 0;
  while (i < xs.length) {
    let j = i; while (j + 1 < xs.length && xs[j + 1] === xs[j] + 1) j++;
    out.push(i === j ? String(xs[i]) : xs[i] + '-' + xs[j]); i = j + 1;
  }
  return out.join(',');
}
// -- state in the URL fragment -------------------------------------------------------------
function state() { return new URLSearchParams(location.hash.slice(1)); }
function setState(changes) {
  const s = state();
  for (const [k, v] of Object.entries(changes)) {
    if (v === null || v === '' || v === false) s.delete(k); else s.set(k, v);
  }
  location.hash = s.toString();
}
// -- colour: the verdict metric on a log scale ---------------------------------------------
const RAMP = [[253, 231, 37], [94, 201, 98], [33, 145, 140], [59, 82, 139], [68, 1, 84]];
function ramp(t) {
  t = Math.max(0, Math.min(1, t)) * (RAMP.length - 1);
  const i = Math.min(RAMP.length - 2, Math.floor(t)), f = t - i;
  const c = RAMP[i].map((x, k) => Math.round(x + (RAMP[i + 1][k] - x) * f));
  return 'rgb(' + c.join(',') + ')';
}
function cellColour(hm, st, lv) {
  if (st === 0) return '#e6e6e6';
  if (lv === null) return st === 2 ? '#d62728' : '#f4a582';
  const span = (hm.hi - hm.lo) || 1;
  return ramp((lv - hm.lo) / span);
}
// -- header ----------------------------------------------------------------------------------
document.title = D.title;
app.append(el('h1', {}, D.headline), el('div', {'class': 'muted'}, D.policy),
  el('div', {'id': 'summary', 'class': D.exit_code ? 'bad' : 'ok'}, D.summary));
// -- first divergence ------------------------------------------------------------------------
const first = el('section', {'id': 'first', 'class': 'box' + (D.first ? ' bad-box' : '')});
app.append(el('h2', {}, 'First divergence'), first);
if (!D.first) first.append(el('div', {'class': 'ok'}, 'none: the runs agree within policy'));
else {
  const f = D.first;
  first.append(el('div', {'id': 'first-headline', 'class': 'bad'}, f.head));
  if (f.why) first.append(el('div', {'id': 'first-cause'}, f.why));
  first.append(el('div', {'class': 'muted'}, D.runs.ref.name + ' ranks ' + ranges(f.ranks.ref)
    + '; ' + D.runs.cand.name + ' ranks ' + ranges(f.ranks.cand) + '; rule: ' + f.rule));
  for (const n of f.notes) first.append(el('div', {'class': 'muted'}, 'note: ' + n));
  first.append(el('a', {'class': 'link', 'id': 'first-link', onclick: () => setState(
    {sel: String(f.o), cell: null, verdict: null, phase: null, site: null, breach: null})},
    'select it (table, rank map)'));
  if (f.cell) first.append(el('a', {'class': 'link', onclick: () => scrollToCell(f.cell)},
    'show in heatmap'));
}
// -- graph breaks, grouped by stage ----------------------------------------------------------
if (D.graph_breaks.length) {
  const sec = el('section', {'id': 'graph-breaks', 'class': 'box'});
  app.append(el('h2', {}, 'Backward-graph breaks'), sec);
  for (const g of D.graph_breaks) {
    sec.append(el('h3', {}, g.group));
    const ul = el('ul', {});
    for (const b of g.items) {
      ul.append(el('li', {'class': b.kind === 'none' ? 'bad' : ''}, b.message,
        b.boundary ? el('div', {'class': 'muted'}, b.boundary) : ''));
    }
    sec.append(ul);
  }
  sec.append(el('a', {'class': 'link', onclick: () => setState(
    {verdict: 'grad_none', phase: null, site: null, cell: null})}, 'list the grad_none findings'));
}
if (D.warnings.length) {
  const ul = el('ul', {'id': 'warnings'});
  for (const w of D.warnings) ul.append(el('li', {}, w));
  app.append(el('h2', {}, 'Warnings'), el('section', {'class': 'box'}, ul));
}
// -- heatmaps --------------------------------------------------------------------------------
const hmSec = el('section', {'id': 'heatmaps'});
app.append(el('h2', {}, 'Heatmaps'), hmSec);
function swatch(fill, mark) {
  const s = sv('svg', {width: 14, height: 14});
  s.append(sv('rect', {width: 14, height: 14, fill: fill, stroke: '#999'}));
  if (mark) s.append(sv('rect', {width: 14, height: 14, fill: 'url(#' + mark + ')'}));
  return s;
}
const grad = sv('svg', {width: 120, height: 14});
for (let i = 0; i < 24; i++) grad.append(sv('rect', {x: i * 5, width: 5, height: 14, fill: ramp(i / 23)}));
hmSec.append(el('div', {'class': 'legend'},
  el('span', {}, swatch('#e6e6e6'), ' identical'),
  el('span', {}, swatch(ramp(0.3), 'na-dots'), ' differs within policy (dots)'),
  el('span', {}, swatch(ramp(0.8), 'na-hatch'), ' breaches (hatched)'),
  el('span', {}, 'metric, log scale: low ', grad, ' high'),
  el('span', {}, swatch('#fff'), el('b', {}, ' black frame'), ' = first divergence')));
const info = el('div', {'id': 'cell-info', 'class': 'mono muted'}, 'point at a cell; click it to list its findings');
hmSec.append(info);
const cellRects = [];
function differs(hm) { for (let k = 2; k < hm.cells.length; k += 5) if (hm.cells[k]) return true; return false; }
const anyDiffers = D.heatmaps.some(differs);  // then all-identical phases start folded
const STATES = ['identical', 'within policy', 'breach'];
const CELL_MIN = 16, CELL_MAX = 28;  // px: a cell to read and to point at
D.heatmaps.forEach((hm, h) => {
  const nr = hm.rows.length, nc = hm.cols.length;
  const cw = Math.max(CELL_MIN, Math.min(CELL_MAX, Math.floor(1100 / Math.max(1, nc))));
  const ch = Math.max(CELL_MIN, Math.min(22, Math.floor(900 / Math.max(1, nr))));
  const longest = hm.rows.reduce((m, r) => Math.max(m, r.length), 0);
  const lw = Math.max(90, Math.min(330, 10 + 6.1 * Math.min(longest, 52)));
  const hasMb = hm.col_mbs.some((m) => m !== '');
  const mbLen = hm.col_mbs.reduce((m, x) => Math.max(m, x.length), 0);
  const mbVertical = hasMb && mbLen * 6.2 + 2 > cw;  // labels that do not fit across a cell
  const stepRow = 14, mbRow = hasMb ? (mbVertical ? 6.2 * mbLen + 8 : 14) : 0;
  const top = stepRow + mbRow + 6;
  const svg = sv('svg', {width: lw + nc * cw + 20, height: top + nr * ch + 4, 'data-phase': hm.phase,
    'data-cell-w': cw, 'data-cell-h': ch});
  // axes: steps on the first header row (one label a run of columns), microbatches below
  const title = (y, text, cls) => { const t = sv('text', {x: lw - 6, y: y, 'text-anchor': 'end',
    'class': 'axis ' + cls}); t.textContent = text; svg.append(t); };
  title(stepRow - 3, 'step', 'x-step');
  if (hasMb) title(stepRow + mbRow - 3, 'microbatch', 'x-mb');
  let j0 = 0;
  while (j0 < nc) {
    let j1 = j0; while (j1 + 1 < nc && hm.col_steps[j1 + 1] === hm.col_steps[j0]) j1++;
    const span = (j1 - j0 + 1) * cw, text = hm.col_steps[j0];
    if (text.length * 6.2 <= span + 4 || j0 === j1) {
      const t = sv('text', {x: lw + j0 * cw + span / 2, y: stepRow - 3, 'text-anchor': 'middle',
        'class': 'col-step'});
      t.textContent = text; svg.append(t);
    }
    svg.append(sv('line', {x1: lw + j0 * cw, x2: lw + j0 * cw, y1: 0, y2: top - 2, 'class': 'tick'}));
    j0 = j1 + 1;
  }
  if (hasMb) hm.col_mbs.forEach((m, j) => {
    const x = lw + j * cw + cw / 2, y = stepRow + mbRow - 3;
    const t = sv('text', mbVertical ? {x: x + 3, y: y, transform: 'rotate(-90 ' + (x + 3) + ' ' + y + ')',
      'class': 'col-mb'} : {x: x, y: y, 'text-anchor': 'middle', 'class': 'col-mb'});
    t.textContent = m; svg.append(t);
  });
  const rowTitle = sv('text', {x: 2, y: top - 4, 'class': 'axis y-axis'});
  rowTitle.textContent = 'module ↓'; if (!hasMb) svg.append(rowTitle);
  hm.rows.forEach((r, i) => {
    const t = sv('text', {x: lw - 4, y: top + i * ch + ch / 2 + 4, 'text-anchor': 'end', 'class': 'row-label'});
    t.textContent = r.length > 52 ? r.slice(0, 20) + '…' + r.slice(-31) : r;
    svg.append(t);
  });
  const rects = new Map();
  const cells = hm.cells;
  const marks = ['', '', ''];  // one path per state: thousands of cells, two elements
  for (let k = 0; k < cells.length; k += 5) {
    const r = cells[k], c = cells[k + 1], st = cells[k + 2], lv = cells[k + 3];
    const x = lw + c * cw, y = top + r * ch;
    const rect = sv('rect', {x: x, y: y, width: cw, height: ch, 'class': 'cell s' + st,
      fill: cellColour(hm, st, lv), 'data-h': h, 'data-r': r, 'data-c': c, 'data-k': k});
    const tip = sv('title'); tip.textContent = hm.rows[r] + ' @ step ' + hm.col_steps[c]
      + (hm.col_mbs[c] !== '' ? ' mb ' + hm.col_mbs[c] : '') + ': ' + STATES[st]; rect.append(tip);
    svg.append(rect);
    if (st) marks[st] += 'M' + x + ' ' + y + 'h' + cw + 'v' + ch + 'h' + (-cw) + 'z';
    rects.set(r + ',' + c, rect);
  }
  if (marks[1]) svg.append(sv('path', {d: marks[1], 'class': 'mark', fill: 'url(#na-dots)'}));
  if (marks[2]) svg.append(sv('path', {d: marks[2], 'class': 'mark', fill: 'url(#na-hatch)'}));
  cellRects.push(rects);
  svg.addEventListener('mouseover', (ev) => {
    const t = ev.target; if (!t.classList || !t.classList.contains('cell')) return;
    const k = +t.dataset.k, c = cells[k + 1];
    info.textContent = hm.phase + ' | ' + hm.rows[cells[k]] + ' | step ' + hm.col_steps[c]
      + (hm.col_mbs[c] !== '' ? ' microbatch ' + hm.col_mbs[c] : '') + ' | '
      + STATES[cells[k + 2]] + ' | worst metric ' + (cells[k + 3] === null ? '-' : fmt(Math.pow(10, cells[k + 3])))
      + ' | ' + cells[k + 4] + (cells[k + 4] === 1 ? ' key' : ' keys');
  });
  svg.addEventListener('click', (ev) => {
    const t = ev.target; if (!t.classList || !t.classList.contains('cell')) return;
    setState({cell: [h, t.dataset.r, t.dataset.c].join('.'), sel: null});
  });
  const note = (hm.rows.length < hm.sites || hm.cols.length < hm.columns)
    ? ' (aggregated: ' + plural(hm.sites, 'module') + ' in ' + plural(nr, 'row') + ', '
      + plural(hm.steps, 'step') + (hasMb ? ' × ' + plural(hm.microbatches, 'microbatch', 'microbatches') : '') + ' in ' + plural(nc, 'column')
      + '; a cell shows its worst key)' : '';
  const fold = el('details', {'class': 'hm-phase', 'data-phase': hm.phase},
    el('summary', {}, el('b', {}, hm.phase), ': ' + plural(hm.sites, 'module') + ' × '
      + plural(hm.steps, 'step') + (hasMb ? ' × ' + plural(hm.microbatches, 'microbatch', 'microbatches') : '')
      + (differs(hm) ? '' : ', all identical') + note),
    el('div', {'class': 'hm', 'id': 'hm-' + hm.phase}, svg));
  if (differs(hm) || !anyDiffers) fold.open = true;
  hmSec.append(fold);
});
function mark(cell, cls, id) {
  const old = document.getElementById(id); if (old) old.remove();
  if (!cell) return null;
  const rect = cellRects[cell[0]] && cellRects[cell[0]].get(cell[1] + ',' + cell[2]);
  if (!rect) return null;
  rect.closest('details').open = true;
  const m = sv('rect', {x: rect.getAttribute('x'), y: rect.getAttribute('y'), width: rect.getAttribute('width'),
    height: rect.getAttribute('height'), 'class': cls, id: id});
  rect.parentNode.append(m);
  return rect;
}
function scrollToCell(cell) {
  const r = mark(cell, 'sel-mark', 'sel-outline'); if (r) r.scrollIntoView({block: 'center'});
}
if (D.first && D.first.cell) {
  const r = mark(D.first.cell, 'first-mark', 'first-outline');
  if (r) { r.id = 'first-cell'; r.classList.add('first'); }
}
// -- the selected finding: rank / piece map --------------------------------------------------
const rankSec = el('section', {'id': 'rank-map', 'class': 'box'});
app.append(el('h2', {}, 'Rank and piece map of the selected finding'), rankSec);
function rankMap(f) {
  rankSec.textContent = '';
  if (!f) { rankSec.append(el('div', {'class': 'muted'}, 'select a finding in the table')); return; }
  rankSec.append(el('div', {'class': f.breach ? 'bad' : ''}, f.head));
  if (f.why) rankSec.append(el('div', {}, f.why));
  for (const n of f.notes) rankSec.append(el('div', {'class': 'muted'}, 'note: ' + n));
  const p = f.pieces || {};
  const differ = new Set();
  for (const d of (p.differ || [])) for (const r of d.ranks) differ.add(r);
  for (const side of ['ref', 'cand']) {
    const run = D.runs[side], held = new Set(f.ranks[side] || []);
    const pside = p.side || 'cand';
    const grid = el('div', {'class': 'ranks', 'data-side': side});
    const n = Math.min(run.world_size, 1024);
    for (let r = 0; r < n; r++) {
      const bad = pside === side && differ.has(r);
      grid.append(el('div', {'class': 'rk' + (held.has(r) ? ' held' : '') + (bad ? ' differ' : ''),
        title: 'rank ' + r + (held.has(r) ? ' holds a piece' : '') + (bad ? ', differs' : '')}, bad ? '✕' + r : r));
    }
    rankSec.append(el('div', {}, side + ' ' + run.name + ' (' + plural(run.world_size, 'rank') + '; blue: holds a piece'
      + (pside === side && differ.size ? ', red ✕: its piece differs' : '') + ')'), grid);
  }
  if (p.cannot_localize) rankSec.append(el('div', {'class': 'muted'}, 'cannot localize: ' + p.cannot_localize));
  for (const d of (p.differ || [])) {
    const mesh = Object.entries(d.mesh || {}).map(([k, v]) => k + '=' + v).join(', ');
    rankSec.append(el('div', {'class': 'mono'}, 'ranks ' + ranges(d.ranks) + (mesh ? ' (' + mesh + ')' : '')
      + ' box ' + (d.box || '') + ' rel_l2 ' + fmt(d.rel_l2)));
  }
  if (p.differ && p.method) rankSec.append(el('div', {'class': 'muted'}, (p.differ_count || p.differ.length) + ' pieces differ, '
    + (p.agree || 0) + ' agree (by ' + p.method + ')'));
  if (f.cell) rankSec.append(el('a', {'class': 'link', onclick: () => scrollToCell(f.cell)}, 'show in heatmap'));
}
// -- breaching findings grouped by cause -----------------------------------------------------
if (D.groups.length) {
  const ul = el('ul', {'id': 'groups'});
  for (const g of D.groups) {
    const li = el('li', {'data-group': g.index}, el('span', {'class': 'bad'}, 'G' + g.index + ': ' + g.headline));
    if (g.why) li.append(el('div', {}, g.why));
    if (g.factor) li.append(el('div', {'class': 'muted'}, 'factor: ' + g.factor));
    for (const n of g.notes) li.append(el('div', {'class': 'muted'}, 'note: ' + n));
    li.append(el('div', {'class': 'keys'}, 'keys: ' + g.sites),
      el('a', {'class': 'link', onclick: () => setState({group: String(g.index), verdict: null,
        phase: null, site: null, cell: null, breach: null})}, 'list its ' + plural(g.count, 'finding')));
    ul.append(li);
  }
  app.append(el('h2', {}, 'Breaching findings by cause (' + plural(D.groups.length, 'group') + ')'),
    el('section', {'class': 'box'}, ul));
}
// -- the findings table ----------------------------------------------------------------------
const tabSec = el('section', {'id': 'findings'});
app.append(el('h2', {}, 'Findings (not identical)'), tabSec);
const fVerdict = el('select', {'id': 'f-verdict'}, el('option', {value: ''}, 'any verdict'));
for (const v of D.verdicts) if (v !== 'identical') fVerdict.append(el('option', {value: v}, v));
const fPhase = el('select', {'id': 'f-phase'}, el('option', {value: ''}, 'any phase'));
for (const hm of D.heatmaps) fPhase.append(el('option', {value: hm.phase}, hm.phase));
const fSite = el('input', {'id': 'f-site', type: 'search', placeholder: 'site contains…'});
const fBreach = el('input', {'id': 'f-breach', type: 'checkbox'});
fVerdict.addEventListener('change', () => setState({verdict: fVerdict.value}));
fPhase.addEventListener('change', () => setState({phase: fPhase.value}));
fSite.addEventListener('change', () => setState({site: fSite.value}));
fBreach.addEventListener('change', () => setState({breach: fBreach.checked ? '1' : null}));
const count = el('span', {'id': 'f-count', 'class': 'muted'});
tabSec.append(el('div', {'class': 'filters'}, fVerdict, fPhase, fSite, el('label', {}, fBreach, ' breaches only'),
  el('a', {'class': 'link', onclick: () => { location.hash = ''; }}, 'clear'), count));
if (D.findings.length < D.findings_listed) tabSec.append(el('div', {'class': 'muted'}, 'the table holds '
  + D.findings.length + ' of ' + D.findings_listed + ' non-identical findings (breaches first); '
  + '`auditor compare --format json` has every finding'));
const GROUP_FIRST = new Map(D.groups.map((g) => [g.index, g.first]));
function cellText(f, k) {
  const v = f[k];
  if ((k === 'mb' || k === 'stage') && (v === null || v < 0)) return '';
  if (k === 'role') return f.role + (f.index ? '[' + f.index + ']' : '') + (f.call ? ' call ' + f.call : '');
  if (k === 'threshold') return f.measure && f.measure[0] !== '×' && v !== null ? fmt(v) : '';
  if (k === 'group') return v === null || v === undefined ? '' : 'G' + v;
  // a group's cause is said once, on its first finding (and in the section above)
  if (k === 'why' && f.group !== null && f.group !== undefined && GROUP_FIRST.get(f.group) !== f.o)
    return 'as G' + f.group + "'s first";
  return v === null || v === undefined ? '' : String(v);
}
const ALL_COLS = [['o', '#'], ['step', 'step'], ['mb', 'mb'], ['phase', 'phase'], ['site', 'site'], ['role', 'role'],
  ['verdict', 'verdict'], ['stage', 'stage'], ['measure', 'measure'], ['threshold', 'threshold'],
  ['group', 'group'], ['why', 'cause / detail']];
// no column that would be empty on every row (no stage when nothing is pipelined)
const COLS = ALL_COLS.filter(([k]) => k === 'o' || D.findings.some((f) => cellText(f, k) !== ''));
const thead = el('tr', {});
for (const [k, label] of COLS) {
  thead.append(el('th', {'data-sort': k, onclick: () => {
    const s = state(); setState({sort: k, desc: s.get('sort') === k && !s.get('desc') ? '1' : null});
  }}, label));
}
const tbody = el('tbody', {'id': 'findings-body'});
const moreLink = el('a', {'class': 'link', 'id': 'f-more', onclick: () => setState({more: '1'})}, 'list all');
tabSec.append(el('table', {'id': 'findings-table'}, el('thead', {}, thead), tbody), moreLink);
function num(v) { return v === null || v === undefined ? -Infinity : (typeof v === 'string' ? (v[0] === '-' ? -Infinity : Infinity) : v); }
const MAX_SHOWN = 200;  // rows built at once; `more=1` in the fragment lists all
function render() {
  const s = state();
  const verdict = s.get('verdict') || '', phase = s.get('phase') || '', site = (s.get('site') || '').toLowerCase();
  const breach = s.get('breach') === '1', cell = s.get('cell'), sel = s.get('sel');
  const group = s.get('group');
  fVerdict.value = verdict; fPhase.value = phase; fSite.value = s.get('site') || ''; fBreach.checked = breach;
  let rows = D.findings.filter((f) => (!verdict || f.verdict === verdict) && (!phase || f.phase === phase)
    && (!site || f.site.toLowerCase().includes(site)) && (!breach || f.breach)
    && (!cell || (f.cell && f.cell.join('.') === cell)) && (group === null || String(f.group) === group));
  const key = s.get('sort');
  if (key) {
    const dir = s.get('desc') ? -1 : 1;
    const numeric = ['o', 'step', 'mb', 'stage', 'measure', 'threshold', 'group'].includes(key);
    const field = key === 'measure' ? 'mnum' : key;
    rows = rows.slice().sort((a, b) => dir * (numeric ? num(a[field]) - num(b[field])
      : String(a[field]).localeCompare(String(b[field]))));
  }
  tbody.textContent = '';
  const shown = s.get('more') ? rows.length : MAX_SHOWN;
  for (const f of rows.slice(0, shown)) {
    const tr = el('tr', {'class': 'finding' + (f.breach ? ' breach' : '') + (String(f.o) === sel ? ' selected' : ''),
      'data-o': f.o, onclick: () => setState({sel: String(f.o)})});
    for (const [k] of COLS) tr.append(el('td', {'class': k}, cellText(f, k)));
    tbody.append(tr);
  }
  count.textContent = rows.length + ' of ' + D.findings.length + ' findings match'
    + (rows.length > shown ? ' (first ' + shown + ' listed)' : '');
  moreLink.style.display = rows.length > shown ? '' : 'none';
  let selected = sel !== null ? D.findings.find((f) => String(f.o) === sel) : null;
  if (!selected && sel !== null && D.first && String(D.first.o) === sel) selected = D.first;
  rankMap(selected || null);
  const outline = selected ? selected.cell : (cell ? cell.split('.').map(Number) : null);
  mark(outline, 'sel-mark', 'sel-outline');
}
window.addEventListener('hashchange', render);
render();
document.body.setAttribute('data-ready', '1');
document.body.setAttribute('data-render-ms', String(Math.round(performance.now())));
requestAnimationFrame(() => setTimeout(() => document.body.setAttribute('data-painted-ms',
  String(Math.round(performance.now()))), 0));
})();
"""
