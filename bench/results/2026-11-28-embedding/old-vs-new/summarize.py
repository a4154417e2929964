"""Medians, paired ratios, exposed waits and bytes of run.sh's before/after runs."""
import glob, json, os, statistics, sys

out = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
def load(mode, v, r):
    return json.load(open(f"{out}/{mode}_{v}.r{r}.json"))
rounds = sorted({int(p.split(".r")[1].split(".")[0]) for p in glob.glob(f"{out}/a_old.r*.json")})
for mode in ("a", "a5", "a2"):
    old = [load(mode, "old", r) for r in rounds]
    new = [load(mode, "new", r) for r in rounds]
    med = lambda runs, k: statistics.median(j[k] for j in runs)
    paired = statistics.median(n["median_step_s"] / o["median_step_s"] for o, n in zip(old, new))
    print(f"{mode}: step {med(old, 'median_step_s'):.3f} -> {med(new, 'median_step_s'):.3f} s "
          f"(ratio {med(new, 'median_step_s') / med(old, 'median_step_s'):.3f}, paired {paired:.3f}); "
          f"exposed wait {1e3 * med(old, 'median_exposed_comm_s'):.1f} -> "
          f"{1e3 * med(new, 'median_exposed_comm_s'):.1f} ms; bytes/rank/step "
          f"{old[0]['comm']['bytes_sent_per_step'] / 1e6:.1f} -> {new[0]['comm']['bytes_sent_per_step'] / 1e6:.1f} MB; "
          f"loss {old[0]['loss_last']:.7f} / {new[0]['loss_last']:.7f}")
