// Helpers that apply the _config to the rule and dashboard texts.
{
  // `{@}` and `,@}` mark where the selector goes in an expression: `metric{@}` becomes
  // `metric{<selector>}` (or `metric` when the selector is empty), `m{a="b",@}` becomes
  // `m{a="b",<selector>}` (or `m{a="b"}`).
  select(text, selector)::
    local some = selector != '';
    std.strReplace(
      std.strReplace(text, '{@}', if some then '{' + selector + '}' else ''),
      ',@}',
      if some then ',' + selector + '}' else '}'
    ),

  // `$(key)` becomes the string value of `_config.key` (an unknown key is an error).
  fill(text, config)::
    local parts = std.split(text, '$(');
    parts[0] + std.join('', [
      local kv = std.splitLimit(part, ')', 1);
      config[kv[0]] + kv[1]
      for part in parts[1:]
    ]),

  // A rule with the selector and the settings applied to its expression, annotations and `for`.
  rule(r, config)::
    local apply(t) = $.fill($.select(t, config.selector), config);
    r + { expr: apply(r.expr) }
    + (if std.objectHas(r, 'for') then { 'for': $.fill(r['for'], config) } else {})
    + (
      if std.objectHas(r, 'annotations') then {
        annotations: {
          [k]: $.fill(r.annotations[k], config)
          for k in std.objectFields(r.annotations)
        },
      } else {}
    ),

  // '15m' -> '15 minutes', '1h' -> '1 hour', '30s' -> '30 seconds' (a single-unit duration;
  // anything else is kept as written).
  durationText(d)::
    local units = { s: 'second', m: 'minute', h: 'hour', d: 'day' };
    local n = std.substr(d, 0, std.length(d) - 1);
    local u = std.substr(d, std.length(d) - 1, 1);
    if std.objectHas(units, u) && std.length(n) > 0 && std.all([std.member('0123456789', ch) for ch in std.stringChars(n)])
    then n + ' ' + units[u] + (if n == '1' then '' else 's')
    else d,

  // A PromQL number literal as people write it: '1e-06' -> '1e-6' (others as written).
  numberText(x)::
    std.strReplace(std.strReplace(x, 'e-0', 'e-'), 'e+0', 'e+'),
}
