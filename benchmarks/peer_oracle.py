"""A bench run's methods against llama.cpp's n-gram types, their best type and their per-prompt oracle.

    python benchmarks/peer_oracle.py RESULTS.json

Per request, each method's and peer's median-rate repeat; aggregates are total tokens over total time (all, code,
edit).  llama.cpp's per-prompt oracle takes, for each request, the best of its speculative types after the fact:
what a user who knew in advance which type suits which prompt would get."""
import collections
import json
import statistics as st
import sys
d = json.load(open(sys.argv[1]))
tok = collections.defaultdict(lambda: collections.defaultdict(list))   # method -> request -> [(tokens, seconds)]
cat = {}
for r in d['runs']:
    s = r['stats']; tok[r['method'] if r['method'] == 'none' else f"{r['method']}"][r['request']].append((s['n_tokens'], s['decode_s'])); cat[r['request']] = r['category']
for p in d['peers']:
    name = p['method'] + ('' if p.get('kernels', 'stock') == 'stock' else ' [ours]')
    tok[name][p['request']].append((p['n_tokens'], p['decode_s']))
def med(xs): return st.median(n / s for n, s in xs)
reqs = sorted(cat, key=lambda q: (cat[q], q))
methods = list(tok)
def agg(m, sel):  # total tokens / total time over the median-rate repeat per request
    T = S = 0
    for q in sel:
        xs = sorted(tok[m][q], key=lambda x: x[0] / x[1]); n, s = xs[len(xs) // 2]; T += n; S += s
    return T / S
peers = [m for m in methods if m.startswith('llama-') and m != 'llama-plain']
for group, sel in (('all', reqs), ('code', [q for q in reqs if cat[q] == 'code']), ('edit', [q for q in reqs if cat[q] == 'edit'])):
    row = {m: agg(m, sel) for m in methods}
    oracle_T = oracle_S = 0
    for q in sel:  # llama.cpp's per-prompt oracle: the best of its types per prompt, after the fact
        best = max(peers, key=lambda m: med(tok[m][q]))
        xs = sorted(tok[best][q], key=lambda x: x[0] / x[1]); n, s = xs[len(xs) // 2]; oracle_T += n; oracle_S += s
    best_type = max(peers, key=lambda m: row[m])
    print(f"{group}: " + ", ".join(f"{m} {v:.1f}" for m, v in row.items()) + f" | llama oracle {oracle_T / oracle_S:.1f} | best type {best_type}")
print()
print("request | " + " | ".join(methods))
for q in reqs:
    print(q, "|", " | ".join(f"{med(tok[m][q]):.1f}" for m in methods))
