"""The console's pages, as Jinja2 templates rendered on the server (autoescaped: every
value a tenant controls is text, never markup)."""

from __future__ import annotations

__all__ = ["TEMPLATES"]

_BASE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{% block title %}{% endblock %} · langgraph-fence</title>
<style>
body { font: 14px/1.45 system-ui, sans-serif; margin: 0; color: #1d2330; background: #f6f7f9; }
header { background: #1d2330; color: #fff; padding: 8px 20px; display: flex; gap: 18px;
  align-items: center; flex-wrap: wrap; }
header a { color: #cfe0ff; text-decoration: none; }
header a.here { color: #fff; font-weight: 600; border-bottom: 2px solid #7fb0ff; }
header .brand { font-weight: 700; color: #fff; margin-right: 12px; }
header .who { margin-left: auto; font-size: 13px; color: #cdd3df; }
main { padding: 16px 20px; }
h1 { font-size: 20px; margin: 4px 0 12px; } h2 { font-size: 16px; margin: 22px 0 8px; }
table { border-collapse: collapse; background: #fff; width: 100%; }
th, td { border-bottom: 1px solid #e3e6ec; padding: 5px 8px; text-align: left;
  vertical-align: top; }
th { background: #eef1f6; font-weight: 600; font-size: 13px; }
td.key { font-family: ui-monospace, monospace; font-size: 12.5px; word-break: break-all; }
.status { padding: 1px 6px; border-radius: 3px; font-size: 12px; white-space: nowrap; }
.s-running { background: #dcf3e3; } .s-pending { background: #fff4cf; }
.s-waiting { background: #e4ecff; } .s-done { background: #eceff3; }
.s-failed { background: #ffe1de; } .s-dead_lettered { background: #ffb8b0; font-weight: 600; }
.s-cancelled { background: #eee; }
.refused { color: #a3140a; font-weight: 600; } .late { color: #a35b00; }
.stamp-non_idempotent_write { color: #a3140a; font-weight: 600; }
form.filters { display: flex; gap: 8px; flex-wrap: wrap; margin-bottom: 12px; }
form.inline { display: inline-flex; gap: 6px; align-items: center; margin: 2px 0; }
input, select, button { font: inherit; padding: 3px 6px; }
button.danger { background: #a3140a; color: #fff; border: 0; border-radius: 3px; }
button.act { background: #2459c4; color: #fff; border: 0; border-radius: 3px; }
pre { background: #fff; border: 1px solid #e3e6ec; padding: 8px; white-space: pre-wrap;
  word-break: break-all; max-height: 320px; overflow: auto; }
dl.lease { display: grid; grid-template-columns: max-content auto; gap: 3px 16px;
  background: #fff; padding: 10px; border: 1px solid #e3e6ec; }
dl.lease dt { font-weight: 600; } dl.lease dd { margin: 0; }
.note { color: #566; font-size: 13px; } .flash { background: #e6f4ea; padding: 8px;
  border: 1px solid #b7dfc3; margin-bottom: 10px; } .error { background: #fde8e6;
  padding: 8px; border: 1px solid #f3b6ae; margin-bottom: 10px; }
.epoch-row td { border-top: 2px solid #7fb0ff; }
</style></head>
<body>
<header>
  <span class="brand">langgraph-fence</span>
  {% for name, path in nav %}<a href="{{ base }}{{ path }}"
     class="{{ 'here' if here == path else '' }}">{{ name }}</a>{% endfor %}
  <a href="{{ base }}/metrics">/metrics</a>
  <span class="who">
    {% if scope_tenant %}tenant <b>{{ scope_tenant }}</b> · {% endif %}
    {% if actor %}operator <b>{{ actor }}</b>
      {% if token_login %}<form class="inline" method="post" action="{{ base }}/logout">
      <input type="hidden" name="csrf" value="{{ csrf }}">
      <button type="submit">sign out</button></form>{% endif %}
    {% elif can_sign_in %}read-only · <a href="{{ base }}/login">sign in to act</a>
    {% else %}read-only{% endif %}
  </span>
</header>
<main>
{% if flash %}<div class="flash" role="status">{{ flash }}</div>{% endif %}
{% if error %}<div class="error" role="alert">{{ error }}</div>{% endif %}
{% block body %}{% endblock %}
</main></body></html>
"""

_ROWS = """{% macro status(s) %}<span class="status s-{{ s }}">{{ s }}</span>{% endmacro %}
{% macro stamps(row) %}{% for e in row.stamps %}<div class="stamp-{{ e.effect.value }}">
{{ e.effect.value }} @ {{ e.node }} (token {{ e.token }})</div>{% endfor %}{% endmacro %}
{% macro expires(row) %}{% if row.held_back %}held by its flow key{%
elif row.starts_in is not none and row.starts_in > 0 %}starts in {{ '%.1f' % row.starts_in }} s{%
elif row.expires_in is none %}{% elif row.expires_in < 0 %}
<span class="late">expired {{ '%.1f' % -row.expires_in }} s ago</span>{% else %}
in {{ '%.1f' % row.expires_in }} s{% endif %}{% endmacro %}
{% macro resolve_forms(row, csrf, base) %}
<form class="inline" method="post" action="{{ base }}/resolve">
  <input type="hidden" name="csrf" value="{{ csrf }}">
  <input type="hidden" name="key" value="{{ row.scope_key }}">
  <input type="hidden" name="action" value="retry">
  <button class="act" type="submit" title="pending again at the next token, its takeover
budget reset">retry</button></form>
<form class="inline" method="post" action="{{ base }}/resolve">
  <input type="hidden" name="csrf" value="{{ csrf }}">
  <input type="hidden" name="key" value="{{ row.scope_key }}">
  <input type="hidden" name="action" value="abandon">
  <input name="note" required placeholder="what was checked, by whom" size="28"
    aria-label="note for {{ row.scope_key }}">
  <button class="danger" type="submit">abandon</button></form>
{% endmacro %}
{% macro table(rows, base, actor, csrf, actions=False) %}
<table class="executions"><thead><tr><th>execution</th><th>graph</th><th>thread</th>
<th>status</th><th>holder</th><th>token</th><th>expires (store clock)</th>
<th>stamps standing</th><th>reason</th><th>updated</th>
{% if actions and actor %}<th>resolve</th>{% endif %}</tr></thead><tbody>
{% for row in rows %}<tr>
<td class="key"><a href="{{ base }}/executions/{{ row.scope_key | keypath }}">{{
  row.key.execution_id }}</a><div class="note">tenant {{ row.key.tenant_id }}</div></td>
<td>{{ row.graph or '' }}</td><td class="key">{{ row.thread_id or '' }}</td>
<td>{{ status(row.status) }}</td><td class="key">{{ row.holder or '' }}</td>
<td>{{ row.epoch }}</td><td>{{ expires(row) }}</td><td>{{ stamps(row) }}</td>
<td>{{ row.reason or '' }}</td><td>{{ row.updated_at | when }}</td>
{% if actions and actor %}<td>{{ resolve_forms(row, csrf, base) }}</td>{% endif %}
</tr>{% else %}<tr><td colspan="11" class="note">none</td></tr>{% endfor %}
</tbody></table>{% endmacro %}
"""

_EXECUTIONS = """{% extends "base.html" %}{% import "rows.html" as r %}
{% block title %}Executions{% endblock %}{% block body %}
<h1>Executions <span class="note">{% if filters.status == 'running' %}by tenant and
execution{% elif filters.status %}newest change first{% else %}newest run first{% endif
%}</span></h1>
<form class="filters" method="get" action="{{ base }}/executions">
{% if not scope_tenant %}<input name="tenant" placeholder="tenant" value="{{ filters.tenant or ''
}}" aria-label="tenant">{% endif %}
<select name="status" aria-label="status"><option value="">any status</option>
{% for s in statuses %}<option value="{{ s }}" {{ 'selected' if filters.status == s else ''
}}>{{ s }}</option>{% endfor %}</select>
<input name="graph" placeholder="graph" value="{{ filters.graph or '' }}" aria-label="graph">
<input name="holder" placeholder="holder (instance)" value="{{ filters.holder or '' }}"
  aria-label="holder"><button type="submit">filter</button></form>
{{ r.table(rows, base, actor, csrf) }}
{% if following %}<p><a rel="next" href="{{ base }}/executions?{{ following }}">older →</a></p>
{% endif %}{% endblock %}
"""

_DEAD_LETTERS = """{% extends "base.html" %}{% import "rows.html" as r %}
{% block title %}Dead letters{% endblock %}{% block body %}
<h1>Dead letters</h1>
<p class="note">Each stopped because running it again could repeat a write that may have
happened, or because it crashed its workers. Check what it did, then retry it (pending again at
the next token: refused while a non-idempotent write stands) or abandon it with a note (failed,
its stamps cleared). The same rules as <code>langgraph-fence resolve</code>.</p>
{{ r.table(rows, base, actor, csrf, actions=True) }}
{% if following %}<p><a rel="next" href="{{ base }}/dead-letters?{{ following }}">older →</a></p>
{% endif %}{% endblock %}
"""

_EXECUTION = """{% extends "base.html" %}{% import "rows.html" as r %}
{% block title %}{{ d.row.key.execution_id }}{% endblock %}{% block body %}
<h1>Execution <span class="key">{{ d.row.key.execution_id }}</span>
<span class="note">tenant {{ d.row.key.tenant_id }}</span></h1>
<dl class="lease">
<dt>status</dt><dd>{{ r.status(d.row.status) }}</dd>
<dt>graph</dt><dd>{{ d.row.graph or '(no record)' }}</dd>
<dt>thread</dt><dd class="key">{{ d.row.thread_id or '' }}</dd>
<dt>holder</dt><dd class="key">{{ d.row.holder or '(none)' }}</dd>
<dt>token (epoch)</dt><dd>{{ d.row.epoch }}</dd>
<dt>expires</dt><dd>{{ r.expires(d.row) or '(not held)' }}
  <span class="note">on the store's clock</span></dd>
<dt>takeovers in a row</dt><dd>{{ d.row.takeovers }}</dd>
<dt>reason</dt><dd>{{ d.row.reason or '' }}</dd>
<dt>scope key</dt><dd class="key">{{ d.row.scope_key }}</dd>
</dl>
{% if actor and d.row.status in ('dead_lettered', 'cancelled') %}
<h2>Resolve</h2>{{ r.resolve_forms(d.row, csrf, base) }}{% endif %}
<h2>Stamps standing</h2>
{% if d.row.stamps %}<table class="stamps"><thead><tr><th>effect</th><th>node</th><th>token</th>
<th>task</th><th>call</th></tr></thead><tbody>{% for e in d.row.stamps %}<tr
class="stamp-{{ e.effect.value }}"><td>{{ e.effect.value }}</td><td>{{ e.node }}</td>
<td>{{ e.token }}</td><td class="key">{{ e.task_id }}</td><td class="key">{{ e.call }}</td></tr>
{% endfor %}</tbody></table>
<p class="note">A stamp stands from before a write until the step's checkpoint: the write may
have happened.</p>{% else %}<p class="note">none</p>{% endif %}
<h2>Token timeline</h2>
<table class="timeline"><thead><tr><th>token</th><th>when (writer's clock)</th><th>what</th>
<th>who</th><th>detail</th></tr></thead><tbody>
{% for item in timeline %}<tr class="{{ 'epoch-row' if item.first else '' }} {{ item.css }}"
data-token="{{ item.token if item.token is not none else '' }}">
<td>{{ item.token if item.token is not none else '' }}</td><td>{{ item.at | when }}</td>
<td>{{ item.what }}</td><td class="key">{{ item.who or '' }}</td><td>{{ item.detail or '' }}</td>
</tr>{% else %}<tr><td colspan="5" class="note">nothing journaled or checkpointed</td></tr>
{% endfor %}</tbody></table>
<p class="note">From the journal (each take, takeover, refused write, dead letter, operator
action) and the tokens the thread's checkpoints carry.</p>
<h2>Parent and children</h2>
{% if d.parent %}<p>parent: <a class="key" href="{{ base }}/executions/{{ parent_key | keypath
}}">{{ d.parent.execution_id }}</a></p>{% endif %}
{% if d.children %}{{ r.table(d.children, base, actor, csrf) }}
{% elif not d.parent %}<p class="note">no parent, no children</p>{% endif %}
<h2>Input and config, as recorded</h2>
<pre class="input">{{ input_text }}</pre>
<pre class="config">{{ config_text }}</pre>
{% endblock %}
"""

_QUEUE = """{% extends "base.html" %}{% block title %}Queue{% endblock %}{% block body %}
<h1>Run queue</h1>
<table class="queue"><thead><tr><th>graph</th><th>tenant</th><th>pending</th><th>running</th>
<th>waiting</th><th>queued runs</th><th>oldest pending</th><th>served by</th></tr></thead><tbody>
{% for q in rows %}<tr><td>{{ q.graph }}</td><td>{{ q.tenant_id }}</td><td>{{ q.pending }}</td>
<td>{{ q.running }}</td><td>{{ q.waiting }}</td><td>{{ q.queued_runs }}</td>
<td>{{ '' if q.oldest_age is none else '%.1f s' % q.oldest_age }}</td>
<td>{% if served.get(q.graph) %}{{ served[q.graph] | join(', ') }}{% else %}<span
class="refused">nobody</span>{% endif %}</td></tr>
{% else %}<tr><td colspan="8" class="note">nothing pending, running or waiting</td></tr>
{% endfor %}</tbody></table>{% endblock %}
"""

_INSTANCES = """{% extends "base.html" %}{% block title %}Instances{% endblock %}
{% block body %}<h1>Instances</h1>
<table class="instances"><thead><tr><th>instance</th><th>serves</th><th>running leases held</th>
<th>max_held</th><th>lease TTL</th><th>renewal lateness</th><th>last said</th></tr></thead>
<tbody>{% for i in rows %}<tr><td class="key"><a href="{{ base
}}/executions?status=running&amp;holder={{ i.instance_id | urlencode }}">{{ i.instance_id
}}</a></td><td>{{ i.graphs | join(', ') }}</td>
<td>{{ i.held }}</td><td>{{ i.max_held if i.max_held is not none else '' }}</td>
<td>{{ '' if i.lease_ttl is none else '%g s' % i.lease_ttl }}</td>
<td class="{{ 'late' if i.renewal_late else '' }}">{{ '' if i.renewal_late is none else
'%.3f s' % i.renewal_late }}</td>
<td>{% if i.seen_ago is none %}not serving{% elif i.serving %}{{ '%.0f s ago' % i.seen_ago
}}{% else %}<span class="late">not serving: last said {{ '%.0f s ago' % i.seen_ago
}}</span>{% endif %}</td></tr>
{% else %}<tr><td colspan="7" class="note">no instance serves or holds a lease</td></tr>
{% endfor %}</tbody></table>
<p class="note">Serving instances say what they hold every few seconds; one that stopped saying
so for 30 s is not serving.</p>{% endblock %}
"""

_LOGIN = """{% extends "base.html" %}{% block title %}Sign in{% endblock %}{% block body %}
<h1>Sign in to act</h1>
<form method="post" action="{{ base }}/login">
<p><label>your name (journaled with each action)<br><input name="name" required
  maxlength="100" autocomplete="username"></label></p>
<p><label>operator token<br><input name="token" type="password" required
  autocomplete="current-password"></label></p>
<button class="act" type="submit">sign in</button></form>{% endblock %}
"""

_PROBLEM = """{% extends "base.html" %}{% block title %}{{ title }}{% endblock %}
{% block body %}<h1>{{ title }}</h1>{% endblock %}
"""

#: The templates by name.
TEMPLATES: dict[str, str] = {
    "base.html": _BASE,
    "rows.html": _ROWS,
    "executions.html": _EXECUTIONS,
    "dead_letters.html": _DEAD_LETTERS,
    "execution.html": _EXECUTION,
    "queue.html": _QUEUE,
    "instances.html": _INSTANCES,
    "login.html": _LOGIN,
    "problem.html": _PROBLEM,
}
