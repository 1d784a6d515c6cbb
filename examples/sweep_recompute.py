"""A Hydra sweep comparing the recompute policies, then its summary table.

    python examples/sweep_recompute.py [extra overrides, e.g. model=small trainer.max_steps=20]

Runs ``lightning-mhc-train -m recompute=none,selective,mhc_block,full`` (short
runs on synthetic data) and prints the sweep's summary.csv: the activation
bytes each policy retains, tokens/s of the whole job (median over the timed
steps, with the interquartile range), the median step time and the final
validation loss.
"""
import csv
import pathlib
import subprocess
import sys

if __name__ == "__main__":
    sweep_dir = pathlib.Path("multirun/sweep_recompute")
    command = [sys.executable, "-m", "lightning_mhc.cli.train", "-m", "recompute=none,selective,mhc_block,full",
               "trainer=debug", "data=synthetic", "logger=none", f"hydra.sweep.dir={sweep_dir}", *sys.argv[1:]]
    subprocess.run(command, check=True)
    rows = list(csv.DictReader(open(sweep_dir / "summary.csv")))
    base = float(next(r for r in rows if r["policy"] == "none")["activation_bytes"])
    print(f"{'policy':<10} {'activation bytes':>17} {'vs none':>8} {'tokens/s':>9} {'IQR':>13} "
          f"{'step ms':>8} {'final val loss':>15}")
    for r in rows:
        iqr = f"{float(r['tokens_per_sec_p25']):.0f}-{float(r['tokens_per_sec_p75']):.0f}"
        print(f"{r['policy']:<10} {int(r['activation_bytes']):>17,d} {int(r['activation_bytes']) / base:>8.3f} "
              f"{float(r['tokens_per_sec']):>9.0f} {iqr:>13} {float(r['step_time_ms']):>8.1f} "
              f"{float(r['final_val_loss']):>15.4f}")
