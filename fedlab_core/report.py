"""The reproducibility report: every table and figure of the four papers, our number and its verdict.

Each chapter that judges claims ends with :func:`record`, which writes its verdicts, with the provenance
of the runs behind each, to ``results/<chapter>.json`` next to the executed notebook. :func:`claims_table`
reads those files and lays them against :data:`CATALOGUE`, the list of every table and figure of the four
papers (``METHODS.md`` of the design) and of their abstracts' claims: one row per verdict, a row with the
reason for each entry no chapter can judge, and the chapters' claims that go beyond the papers. Nothing
in it is typed by hand but the catalogue and the reasons: numbers and verdicts come from the results.

A verdict names its source at the start of its claim ("Table 2, DH 80%: ...", "Fig. 2a: ...",
"Sec. 6: ...", "Appendix Table 3, 5/5: ..."); a claim with no such prefix goes beyond the paper. A
chapter that could not judge one of its entries in the profile it ran with says why in ``skipped``;
an entry with neither a verdict nor a reason is an error, raised before any table is made.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping

if TYPE_CHECKING:
    import pandas as pd

    from .store import History
    from .verdicts import Verdicts

RESULTS_DIR = Path("results")
NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"   # the chapters' sources, their titles' home
EMBEDDED = ("fashion_mnist", "fashion_mnist_domains", "digits")   # the data that ships with the environment
BEYOND = "beyond the paper"

# the chapters that judge each paper's claims
CHAPTER_PAPER = {"distrans_toys": "DisTrans", "distrans": "DisTrans", "distrans_ablations": "DisTrans",
                 "ot_alignment": "OT preprocessing", "ot_fedavg": "OT preprocessing",
                 "fedrdn": "FedRDN", "fedrdn_analysis": "FedRDN", "fraug": "FRAug"}
PAPERS = ("DisTrans", "OT preprocessing", "FedRDN", "FRAug")


@dataclass(frozen=True)
class Entry:
    """One table, figure or abstract claim of a paper.

    paper : one of :data:`PAPERS`.
    source : "Table 1", "Fig. 2a", "Sec. 6", "Appendix Table 3" or "abstract".
    claim : what the paper claims there, in a short phrase.
    chapter : the chapter whose verdicts judge it; None when no chapter can.
    setting : the paper's own setting for it (dataset, model), to read the deviations against.
    reason : why no verdict judges it (with ``chapter`` None, or for an illustration a chapter draws).
    covers : for an abstract claim, the sources whose verdicts it rests on.
    """

    paper: str
    source: str
    claim: str
    chapter: str | None
    setting: str = ""
    reason: str = ""
    covers: tuple[str, ...] = ()


CATALOGUE: tuple[Entry, ...] = (
    # DisTrans
    Entry("DisTrans", "abstract", "DisTrans outperforms state-of-the-art FL methods and data augmentation methods "
          "at different degrees of distributional heterogeneity", "distrans", covers=("Table 1", "Table 2")),
    Entry("DisTrans", "Fig. 2a", "offsets make two clients' non-convex losses consistent", "distrans_toys",
          "y = cos(wx), two clients"),
    Entry("DisTrans", "Fig. 2b", "with offsets FedAvg converges on two-client linear regression", "distrans_toys",
          "y = wx, two clients"),
    Entry("DisTrans", "Fig. 3", "client x class heatmaps of the split at several DH", "heterogeneity",
          reason="a picture of the split, no claim to judge; drawn in the heterogeneity chapter"),
    Entry("DisTrans", "Table 1", "DisTrans beats FedAvg, pFedMe, pFedHN, MOON (and FedAwS at DH 100%) at every DH",
          "distrans", "CIFAR-10 and others, LeNet/ResNet"),
    Entry("DisTrans", "Table 2", "DisTrans beats FedAvg + mixup and FedAvg + AdvProp at every DH", "distrans",
          "CH-MNIST"),
    Entry("DisTrans", "Table 3", "the double input channel beats a single one", "distrans_ablations", "CH-MNIST"),
    Entry("DisTrans", "Table 4", "offset aggregation by a network (nn) is best, a plain average worst",
          "distrans_ablations", "CH-MNIST"),
    Entry("DisTrans", "Fig. 4", "a = 0.3 is the best mixing weight", "distrans_ablations", "CH-MNIST"),
    Entry("DisTrans", "Fig. 5", "one local epoch is best", "distrans_ablations", "CH-MNIST"),
    Entry("DisTrans", "Fig. 6", "DisTrans converges as fast as FedAvg and is ahead of it in every round",
          "distrans", "Birds-200, IID"),
    Entry("DisTrans", "Table 5", "DisTrans loses less accuracy than FedAvg as clients grow from 8 to 40",
          "distrans_ablations", "CH-MNIST"),
    Entry("DisTrans", "Table 6", "DisTrans beats pFedHN and MOON with 50 to 500 sampled clients",
          "distrans_ablations", "CIFAR-100"),
    Entry("DisTrans", "Table 7", "the offsets and the double channel add little communication",
          "distrans_ablations", "LeNet, AlexNet, ResNet-18, ResNet-50"),
    Entry("DisTrans", "Fig. 7", "DisTrans's features separate the classes best", "distrans", "one class per client"),
    # OT preprocessing
    Entry("OT preprocessing", "abstract", "OT preprocessing lets FedAvg reach near-perfect accuracy", "ot_fedavg",
          covers=("Table 1",)),
    Entry("OT preprocessing", "Fig. 2", "the clients' channel-wise barycenters and their barycenter", "ot_alignment",
          reason="a picture of the method, no claim to judge; drawn in the OT alignment chapter"),
    Entry("OT preprocessing", "Fig. 3", "images projected onto the target barycenter", "ot_alignment",
          reason="a picture of the method, no claim to judge; drawn in the OT alignment chapter"),
    Entry("OT preprocessing", "Table 1", "FedAvg with OT preprocessing beats FedAvg in every N/P cell, up to 99%",
          "ot_fedavg", "CIFAR-10, the paper's CNN"),
    Entry("OT preprocessing", "Fig. 4", "aligned clients converge faster, in training and test accuracy",
          "ot_fedavg", "CIFAR-10, N = P = 5"),
    Entry("OT preprocessing", "Table 2", "FedAvg + OT beats other methods' published CIFAR-10 numbers", None,
          reason="the other rows are numbers cited from other papers' settings, not runs; the FedAvg with OT "
                 "chapter shows ours beside the paper's two rows"),
    Entry("OT preprocessing", "Appendix Table 3", "the small CNN beats an 8-layer ResNet with OT preprocessing",
          "ot_fedavg", "CIFAR-10"),
    Entry("OT preprocessing", "Sec. 6", "the preprocessing's cost grows as the stated O() bounds", "ot_alignment"),
    # FedRDN
    Entry("FedRDN", "abstract", "FedRDN improves various representative FL methods as a plug-and-play component",
          "fedrdn", covers=("Table 1",)),
    Entry("FedRDN", "Table 1", "FedRDN improves seven FL algorithms and beats + norm and + FedMix (run as NaiveMix)", "fedrdn",
          "Office-Caltech-10 (AlexNet-BN), DomainNet"),
    Entry("FedRDN", "Table 2", "FedRDN improves four FL algorithms on ProstateMRI segmentation", None,
          "ProstateMRI, U-Net, Dice",
          reason="needs the MRI volumes and a segmentation task; the embedded images cannot stand in"),
    Entry("FedRDN", "Table 3", "FedRDN's local models generalise best to other sites", "fedrdn_analysis",
          "Office-Caltech-10"),
    Entry("FedRDN", "Table 4", "FedRDN beats FedRDN-V", "fedrdn_analysis", "Office-Caltech-10"),
    Entry("FedRDN", "Fig. 1", "FedRDN converges faster", "fedrdn_analysis", "Office-Caltech-10"),
    Entry("FedRDN", "Fig. 2", "FedRDN stays ahead as local epochs grow", "fedrdn_analysis", "Office-Caltech-10"),
    Entry("FedRDN", "Fig. 3", "FedRDN's features mix the clients", "fedrdn_analysis", "Office-Caltech-10, t-SNE"),
    # FRAug
    Entry("FRAug", "abstract", "FRAug outperforms the state of the art on three feature-skew benchmarks", "fraug",
          covers=("Table 2",)),
    Entry("FRAug", "Table 1", "fine-tuning the head on more embeddings helps a model trained on scarce data",
          "fraug", "PACS, OfficeHome, ResNet-18"),
    Entry("FRAug", "Table 2", "FRAug beats Single, All, FedAvg, FedProx, pFedAvg, PartialFed and FedBN", "fraug",
          "Digits, PACS, OfficeHome"),
    Entry("FRAug", "Table 3", "each component (RTNet, prototypes, schedule) adds", "fraug", "OfficeHome"),
    Entry("FRAug", "Fig. 2", "FRAug stays ahead of FedAvg from 10% to 100% of the local data", "fraug",
          "OfficeHome"),
)

_SOURCE = re.compile(r"^(Appendix Table|Table|Fig\.|Sec\.) (\d+[a-z]?)\b")


def source_of(claim: str) -> str:
    """The table or figure a claim names first ("Table 2, DH 80%: ..." -> "Table 2"); :data:`BEYOND` for a
    claim that names none."""
    m = _SOURCE.match(claim)
    return f"{m.group(1)} {m.group(2)}" if m else BEYOND


def provenance(h: "History") -> dict[str, Any]:
    """What identifies one run: seed, cache key, code version, device, data checksum, split hash, thread count
    and the versions of the libraries that shape numbers; with its dataset, rounds and training samples."""
    from .runs import RunConfig
    from .store import Archive, archive_key

    meta = h.meta
    archived = archive_key(RunConfig(**h.config), meta.get("device", "cpu"), meta.get("torch"))  # as computed
    return {"seed": h.config["seed"], "key": meta.get("key"), "code_version": meta.get("code_version"),
            "archive_key": archived, "archived": Archive().path(archived).exists(),
            "device": meta.get("device"), "executor": meta.get("executor", "loop"),
            "data_checksum": meta.get("data_checksum"),
            "split_hash": meta.get("split_hash"), "threads": meta.get("threads"),
            "versions": meta.get("versions"), "dataset": h.config["dataset"],
            "model": h.config["model"], "algorithm": h.config["algorithm"], "num_rounds": h.config["num_rounds"],
            "train_samples": (meta.get("samples") or {}).get("train")}


def provenance_table(results: Mapping[str, Mapping[str, Any]]) -> "pd.DataFrame":
    """One row per chapter of :func:`read`'s results: how many runs its verdicts rest on, their seeds, how many
    code versions, data checksums and splits they span, their thread counts, PyTorch versions, and where they
    were computed (device and executor, with counts: "cpu, loop: 120")."""
    import pandas as pd

    rows = []
    for chapter, res in results.items():
        runs = list({r["key"]: r for row in res["rows"] for side in row["runs"] for r in side}.values())
        if not runs:
            continue
        where: dict[str, int] = {}
        for r in runs:
            place = f"{r.get('device') or 'cpu'}, {r.get('executor') or 'loop'}"
            where[place] = where.get(place, 0) + 1
        rows.append({"chapter": chapter, "runs": len(runs), "seeds": ", ".join(map(str, sorted({r["seed"] for r in runs}))),
                     "code versions": len({r["code_version"] for r in runs}),
                     "data checksums": len({r["data_checksum"] for r in runs}),
                     "splits": len({r["split_hash"] for r in runs}),
                     "threads": ", ".join(map(str, sorted({r["threads"] for r in runs}))),
                     "torch": ", ".join(sorted({r["versions"]["torch"] for r in runs})),
                     "computed on": "; ".join(f"{k}: {n}" for k, n in sorted(where.items()))})
    return pd.DataFrame(rows)


def _number(x: float | None) -> float | None:
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else float(x)


def record(found: "Verdicts", chapter: str, section: str = "", deviations: str = "",
           skipped: Mapping[str, str] | None = None, folder: str | Path = RESULTS_DIR) -> Path:
    """Write a chapter's verdicts, with the provenance of their runs, to ``<folder>/<chapter>.json``.

    Parameters
    ----------
    found : the chapter's verdicts, in the order of its table.
    chapter : the chapter's notebook stem (a key of :data:`CHAPTER_PAPER`).
    section : the anchor of the chapter's section that shows the verdicts.
    deviations : what the chapter does differently from the paper, in one phrase.
    skipped : ``{source: reason}`` for the chapter's catalogue entries it did not judge in this run.
    """
    if chapter not in CHAPTER_PAPER:
        raise ValueError(f"chapter: unknown value {chapter!r}; allowed: {', '.join(CHAPTER_PAPER)}")
    from .store import _atomic_write, code_version

    rows = []
    for i, v in enumerate(found.items, 1):
        runs = [[provenance(h) for h in side] for side in v.runs]
        rows.append({"number": i, "claim": v.claim, "source": source_of(v.claim), "paper": v.paper,
                     "ours": v.evidence, "verdict": v.label, "outcome": v.verdict, "category": v.category,
                     "reason": v.reason, "decided": v.decided, "score": v.score, "converged": v.converged,
                     "mean": _number(v.mean), "stderr": _number(v.stderr), "seeds": v.seeds,
                     "low": _number(v.low), "high": _number(v.high), "claimed": _number(v.claimed),
                     "values": [_number(x) for x in v.values], "runs": runs})
    payload = {"chapter": chapter, "paper": CHAPTER_PAPER[chapter], "section": section, "deviations": deviations,
               "skipped": dict(skipped or {}), "code_version": code_version(), "rows": rows}
    path = Path(folder) / f"{chapter}.json"
    _atomic_write(path, lambda f: f.write(json.dumps(payload, indent=1, sort_keys=True).encode()))
    return path


def chapter_title(stem: str, folder: str | Path = NOTEBOOKS) -> str:
    """A chapter's title, the label of every link to it: the first level-one heading ("# ...") of the notebook
    ``<folder>/<stem>.ipynb``."""
    path = Path(folder) / f"{stem}.ipynb"
    lines = (line for cell in json.loads(path.read_text())["cells"] if cell["cell_type"] == "markdown"
             for line in "".join(cell["source"]).splitlines())
    title = next((line[2:].strip() for line in lines if line.startswith("# ")), None)
    if title is None:
        raise ValueError(f"{path}: no level-one heading to take the chapter's title from")
    return title


def read(folder: str | Path = RESULTS_DIR) -> dict[str, dict[str, Any]]:
    """Every chapter's recorded results in `folder`, by chapter."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(Path(folder).glob("*.json"))}


def _strength(row: Mapping[str, Any]) -> str:
    """The evidence behind a verdict in one phrase: data, scale, rounds, seeds, convergence."""
    runs = [r for side in row["runs"] for r in side]
    seeds = f"{row['seeds']} seed{'s' if row['seeds'] != 1 else ''}"
    if not runs:
        return f"{seeds}; measured without training runs"
    datasets = [f"{d} ({'embedded' if d in EMBEDDED else 'real files'})" for d in sorted({r["dataset"] for r in runs})]
    samples = sorted({r["train_samples"] for r in runs if r["train_samples"] is not None})
    rounds = sorted({r["num_rounds"] for r in runs})
    scale = (f"{samples[0]:,}" if len(samples) == 1 else f"{samples[0]:,} to {samples[-1]:,}") if samples else "?"
    span = str(rounds[0]) if len(rounds) == 1 else f"{rounds[0]} to {rounds[-1]}"
    return (f"{', '.join(datasets)}; {scale} training images; {span} rounds; {seeds}"
            + (f"; score: {row['score']}" if row.get("score") else "")
            + ("" if row["converged"] else "; not converged"))


def _ours(row: Mapping[str, Any]) -> str:
    """Our number with the seed count: the mean per-seed difference of an ordering claim with the 95% interval
    the rule decided on; beside a claimed number, our mean ± standard deviation over the seeds (the sample's,
    n - 1: the verdict's standard error times sqrt(n)); a difference in the paper's unit."""
    from .verdicts import difference_text, mean_std

    seeds = f"{row['seeds']} seed{'s' if row['seeds'] != 1 else ''}"
    if row["mean"] is None:
        return f"{seeds}, a run diverged"
    if row["claimed"] is None:
        return difference_text(row["mean"], row.get("low"), row.get("high"), row["seeds"], row["paper"])
    std = row["stderr"] * math.sqrt(row["seeds"]) if row["stderr"] is not None else 0.0
    return f"{mean_std(row['mean'], std, '.3g', '.2g')} ({seeds}), claimed {row['claimed']:.3g}"


def _counted(categories: Iterable[str]) -> str:
    """E.g. "1 held, 2 inconclusive (not converged)", in the order of :data:`~.verdicts.OUTCOMES`."""
    from .verdicts import OUTCOMES

    counts: dict[str, int] = {}
    for o in sorted(categories, key=lambda c: (OUTCOMES.index(c) if c in OUTCOMES else len(OUTCOMES), c)):
        counts[o] = counts.get(o, 0) + 1
    return ", ".join(f"{n} {k}" for k, n in counts.items())


def _summary(categories: Iterable[str]) -> str:
    """E.g. "1 held, 2 inconclusive (not converged); of 3"."""
    categories = list(categories)
    return f"{_counted(categories)}; of {len(categories)}" if categories else "no verdict"


_CLAIMED_DIFFERENCE = re.compile(r"^([+-]\d*\.\d+)( points)?( \([^()]*\))?$")


def claimed_differences(results: Mapping[str, Mapping[str, Any]]) -> "pd.DataFrame":
    """The ordering verdicts whose paper figure is one difference ("+0.284 (CIFAR-10)", "+7.29 points
    (...)"), with the paper's difference and ours (mean and standard error of the per-seed differences),
    in the same unit (points divided by 100), and the verdict: what the papers claimed beside what we
    measured."""
    import pandas as pd

    rows = []
    for chapter, res in results.items():
        for r in res["rows"]:
            m = _CLAIMED_DIFFERENCE.match(r["paper"].strip())
            if r["claimed"] is None and m and r["mean"] is not None:
                claimed = float(m.group(1)) / (100 if m.group(2) else 1)
                rows.append({"paper": res["paper"], "chapter": chapter, "claim": r["claim"], "claimed": claimed,
                             "ours": r["mean"], "stderr": r["stderr"], "outcome": r["outcome"],
                             "verdict": r["verdict"]})
    return pd.DataFrame(rows, columns=["paper", "chapter", "claim", "claimed", "ours", "stderr", "outcome", "verdict"])


def effects(results: Mapping[str, Mapping[str, Any]]) -> "pd.DataFrame":
    """Every recorded verdict with a number, paper by paper (in the order of :data:`PAPERS`): its effect and the
    interval the rule decided on (low and high, NaN where it had none), its outcome and category. The effect of
    an ordering claim is the mean of the per-seed differences; that of a claimed number is ours minus the paper's,
    so that zero is where the rule's decision turns in both. A verdict whose runs diverged has no number and is
    left out."""
    import pandas as pd

    rows = []
    for paper in PAPERS:
        for chapter, res in results.items():
            for r in res["rows"] if res["paper"] == paper else ():
                if r["mean"] is None:
                    continue
                shift = r["claimed"] or 0.0
                low, high = (math.nan if x is None else x - shift for x in (r["low"], r["high"]))
                rows.append({"paper": paper, "chapter": chapter, "claim": r["claim"], "effect": r["mean"] - shift,
                             "low": low, "high": high, "outcome": r["outcome"], "category": r["category"]})
    return pd.DataFrame(rows, columns=["paper", "chapter", "claim", "effect", "low", "high", "outcome", "category"])


COLUMNS = ("paper", "source", "claim", "paper's number", "ours", "verdict", "evidence", "paper's setting", "deviations",
           "chapter", "section", "runs", "command")


def claims_table(results: Mapping[str, Mapping[str, Any]], catalogue: Iterable[Entry] = CATALOGUE,
                 profile: str = "book") -> "pd.DataFrame":
    """One row per claim: the catalogue laid against the chapters' recorded results.

    Raises ValueError, before building anything, for a chapter the catalogue needs that recorded nothing, an
    entry its chapter neither judged nor skipped with a reason, or a verdict naming a source its paper's
    catalogue does not list.
    """
    import pandas as pd

    catalogue = tuple(catalogue)
    needed = sorted({e.chapter for e in catalogue if e.chapter in CHAPTER_PAPER and not e.reason})
    missing = [c for c in needed if c not in results]
    if missing:
        raise ValueError(f"results: no results recorded by chapter(s) {', '.join(missing)}; execute them first "
                         f"(python -m fedlab_core.book --profile {profile})")
    listed = {(e.paper, e.source) for e in catalogue}
    for chapter, res in results.items():
        for r in res["rows"]:
            if r["source"] != BEYOND and (res["paper"], r["source"]) not in listed:
                raise ValueError(f"results: chapter {chapter} judges {r['source']!r}, which the catalogue of "
                                 f"{res['paper']} does not list (claim: {r['claim']!r})")
    gaps = [f"{e.paper} {e.source} ({e.chapter})" for e in catalogue
            if e.chapter in results and not e.reason and not e.covers
            and not any(r["source"] == e.source for r in results[e.chapter]["rows"])
            and e.source not in results[e.chapter].get("skipped", {})]
    if gaps:
        raise ValueError(f"results: no verdict and no reason recorded for {', '.join(gaps)}")

    def row(e: Entry, **values) -> dict[str, Any]:
        res = results.get(e.chapter or "", {})
        base = {"paper": e.paper, "source": e.source, "claim": e.claim, "paper's number": "", "ours": "",
                "verdict": "", "evidence": "", "paper's setting": e.setting, "deviations": res.get("deviations", ""),
                "chapter": e.chapter or "", "section": res.get("section", ""), "runs": [], "command": "",
                "outcome": "", "category": ""}
        return {**base, **values}

    def command(chapter: str) -> str:
        return f"python -m fedlab_core.book --profile {profile} --chapters {chapter}"

    def judged(e: Entry, r: Mapping[str, Any]) -> dict[str, Any]:
        return row(e, claim=r["claim"], **{"paper's number": r["paper"]}, ours=_ours(r), verdict=r["verdict"],
                   evidence=_strength(r), runs=r["runs"], command=command(e.chapter), outcome=r["outcome"],
                   category=r["category"])

    out = []
    for e in catalogue:
        res = results.get(e.chapter or "")
        if e.covers:
            rows = [r for c, x in results.items() if x["paper"] == e.paper for r in x["rows"] if r["source"] in e.covers]
            out.append(row(e, verdict=_summary(r["category"] for r in rows),
                           evidence=f"the verdicts of {' and '.join(e.covers)}"))
        elif e.reason or res is None:
            out.append(row(e, verdict="not judged", evidence=e.reason or f"chapter {e.chapter} not executed"))
        elif e.source in res.get("skipped", {}) and not any(r["source"] == e.source for r in res["rows"]):
            out.append(row(e, verdict="not judged", evidence=res["skipped"][e.source],
                           command=command(e.chapter)))
        else:
            out.extend(judged(e, r) for r in res["rows"] if r["source"] == e.source)
    for chapter, res in results.items():
        for r in res["rows"]:
            if r["source"] == BEYOND:
                out.append(judged(Entry(res["paper"], BEYOND, "", chapter), r))
    return pd.DataFrame(out, columns=[*COLUMNS, "outcome", "category"])


def _by_paper(table: "pd.DataFrame"):
    """Per paper of :data:`PAPERS`: (paper, its judged rows, the decided, the undecided, the not judged), the
    abstract rows left out (they sum up the others)."""
    for paper in PAPERS:
        rows = table[(table["paper"] == paper) & (table["source"] != "abstract")]
        judged = rows[rows["outcome"] != ""]
        undecided = judged["outcome"].isin(["inconclusive", "not comparable"])
        yield paper, judged, judged[~undecided], judged[undecided], rows[rows["verdict"] == "not judged"]


def first_screen(table: "pd.DataFrame") -> str:
    """What the report's reader wants first, in Markdown, per paper, one paragraph each: its claims judged on our
    runs (abstract rows left out: they sum up the others), how many the rule decided and how (held, not held and
    why), why the rest are undecided (not converged at the budget, fewer than five seeds, a degenerate run, a
    decision that did not survive Holm's adjustment, a number not comparable on our data) and which tables and
    figures were not judged at all (each entry's reason). Every decision on training runs stands on converged,
    non-degenerate runs with at least :data:`~.verdicts.MIN_SEEDS` seeds and survived Holm's adjustment within
    its table or figure, so the counts are of decisions after adjustment; a deterministic count or cost is
    decided on its measurement. The decided claims themselves: :func:`decided`."""
    from .verdicts import MIN_SEEDS

    out = []
    for paper, judged, decided_, undecided, not_judged in _by_paper(table):
        out += ["", f"**{paper}**: {len(judged)} claims judged on our runs, {len(decided_)} decided"
                + (f" ({_counted(decided_['category'])})" if len(decided_) else "")
                + (f"; {len(undecided)} undecided ({_counted(undecided['category'])})" if len(undecided) else "")
                + (f"; {len(not_judged)} of the paper's tables and figures not judged "
                   f"({'; '.join(sorted(set(not_judged['evidence'])))})" if len(not_judged) else "") + "."]
    out += ["", f"Every decision that rests on training runs stands on runs that passed the convergence test and learned "
                f"something (none degenerate), with at least {MIN_SEEDS} seeds, and survived Holm's adjustment over the "
                f"claims of its table or figure: the counts are of decisions after adjustment. A deterministic count or "
                f"cost (bytes) is decided on its measurement."]
    return "\n".join(out).strip()


def rounds_text(rounds: int, horizons: Mapping[str, int], preposition: str = "on") -> str:
    """A page's rounds where some of its runs take a longer horizon, for its prose: "90", or "90 (180 on label
    skew)" for `horizons` ``{"label skew": 180}`` (each key as the page names it, after `preposition`)."""
    longer = ", ".join(f"{cap} {preposition} {key}" for key, cap in horizons.items())
    return f"{rounds} ({longer})" if longer else str(rounds)


def protocol(num_rounds: int, stop_at_plateau: bool, validation_monitor: float, tune_seeds: Iterable[int],
             seeds: Iterable[int], looks: int, validation_source: str = "share", converging: bool = False,
             one_class: bool | None = None, horizons: Mapping[str, int] | None = None) -> dict[str, str]:
    """A chapter's sentences on how its runs were tuned, budgeted and judged, from its own parameters (so the
    page reads right under every profile), for glue: ``budget_rule`` (`horizons`: benchmark -> the rounds of its
    runs and tuning where they are not `num_rounds`), ``monitor_rule`` (``RunConfig``'s
    ``validation_monitor`` and ``validation_source``), ``tune_seeds`` (how many, which, and whether the tables
    evaluate on them), ``tune_choice`` (``converging``: see :func:`~fedlab_core.tuning.tune`),
    ``second_look_rule`` and, for a chapter with one class per client (`one_class`: whether that regime is tuned
    on its own benchmark, :func:`~fedlab_core.tuning.one_class_per_client`), ``tune_one_class``."""
    tune_seeds, seeds = sorted(tune_seeds), set(seeds)
    reused = [s for s in tune_seeds if s in seeds]
    listed = ", ".join(map(str, tune_seeds))
    size = "as large as its test set" if validation_monitor == 1 else f"{validation_monitor:g} times its test set"
    monitor = ("the test curve (no validation share is held out), on which the verdicts refuse to decide"
               if not validation_monitor else
               f"a validation set per client, {size} and with its classes, drawn from the training images that no "
               "client holds (no client gives up training data), never the test set" if validation_source == "unused"
               else f"a validation share held out of each client's training images ({validation_monitor:.0%}), never "
               "the test set")
    choice = ("the smallest rate within one standard error (over the seeds) of the best is chosen"
              if len(tune_seeds) > 1 else "with one seed there is no standard error, and the best score is chosen")
    if converging and len(tune_seeds) > 1:
        choice = ("of the rates within one standard error (over the seeds) of the best, those whose tuning runs have "
                  "converged by their last round (the mean of their validation curves over the seeds passes the "
                  "convergence test) come first, then the smallest")
    longer = "".join(f", {cap} on {key}" for key, cap in (horizons or {}).items())
    if stop_at_plateau:
        budget_rule = (f"Every run stops once its convergence test passes (at most {num_rounds} rounds{longer}), so the "
                       "arms of a comparison may stop at different rounds: the verdicts then read unequal budgets.")
    elif horizons:
        budget_rule = (f"Every run trains for all its benchmark's rounds, {rounds_text(num_rounds, horizons)}, so both "
                       "arms of every comparison get one budget; a benchmark given more rounds is tuned at them.")
    else:
        budget_rule = f"Every run trains for all {num_rounds} rounds, so both arms of every comparison get one budget."
    return {
        "budget_rule": budget_rule,
        "monitor_rule": monitor,
        "tune_seeds": f"{len(tune_seeds)} seed{'s' * (len(tune_seeds) > 1)} ({listed}), "
        + ("which the tables also evaluate on" if reused == tune_seeds else
           f"of which the tables also evaluate on {', '.join(map(str, reused))}" if reused else
           "none of which the tables evaluate on"),
        "tune_choice": choice,
        "second_look_rule": ("Where five seeds leave a claim's interval straddling, or its interval decides but Holm's "
                             "adjustment over its table does not, five more are added (the rule's second look)."
                             if looks > 1 else
                             "A claim whose interval straddles stays undecided (LOOKS = 1: no second look)."),
        **({} if one_class is None else {"tune_one_class": (
            "One class per client is tuned on its own benchmark: on clients that each hold one class, whose "
            "validation data hold as many negatives as positives, as their test data do; a rate whose tuning runs "
            "are degenerate (a model answering each client with its own class scores 0.5 there) is never chosen "
            "while a sound one remains." if one_class else
            "One class per client takes the label-skew benchmark's rates (TUNE_ONE_CLASS = True tunes that regime "
            "on its own benchmark).")}),
    }


def budget(rounds: int | str, stop_at_plateau: bool, tune_seeds: Iterable[int] = (),
           tune_rounds: int | str | None = None) -> str:
    """The phrase a chapter's ``deviations`` (:func:`record`) gives its budget and, with `tune_seeds`, its tuning,
    from its own parameters, so the report never says runs stopped at convergence where every run trained for
    all its rounds: "every run trained for all 180 rounds; learning rates tuned on seeds 100, 101, 102 at 180
    rounds"."""
    def counted(n: int | str) -> str:
        return f"{n} round{'s' * (str(n) != '1')}"

    text = (f"each run stopped once its convergence test passed (at most {counted(rounds)})" if stop_at_plateau
            else f"every run trained for all {counted(rounds)}")
    seeds = sorted(tune_seeds)
    if seeds:
        text += (f"; learning rates tuned on seed{'s' * (len(seeds) > 1)} {', '.join(map(str, seeds))}"
                 + (f" at {counted(tune_rounds)}" if tune_rounds is not None else ""))
    return text


def decided(table: "pd.DataFrame") -> str:
    """Every claim the rule decided, in Markdown, paper by paper: its verdict and the claim, linked to its
    chapter (labelled with the chapter's title); the undecided ones are counted by :func:`first_screen`."""
    out = []
    for paper, _, decided_, _, _ in _by_paper(table):
        out += ["", f"**{paper}**" + ("" if len(decided_) else ": none decided.")]
        if len(decided_):
            out.append("")
            out += [f"- *{r['verdict']}*: {r['claim']} ([{chapter_title(r['chapter'])}]({r['chapter']}.ipynb))"
                    for _, r in decided_.iterrows()]
    return "\n".join(out).strip()


def headlines(table: "pd.DataFrame", shown: int = 3, folder: str = "chapters/") -> str:
    """The landing page's findings, in HTML (it is pasted into another page): per paper, how many of its
    claims judged on our runs the rule decided and how, and up to `shown` of the decided ones (held first),
    each linked to its chapter's page under `folder`; the rest are one click away in the report."""
    import html

    order_ = {"held": 0, "reached": 0}
    items = []
    for paper, judged, decided, undecided, _ in _by_paper(table):
        ranked = sorted(decided.to_dict("records"), key=lambda r: order_.get(r["outcome"], 1))
        claims = [f'<li><em>{html.escape(r["verdict"])}</em>: {html.escape(r["claim"])} '
                  f'(<a href="{folder}{r["chapter"]}.html">{html.escape(chapter_title(r["chapter"]))}</a>)</li>'
                  for r in ranked[:shown]]
        if len(ranked) > shown:
            claims.append(f'<li>{len(ranked) - shown} more in <a href="{folder}report.html">the report</a></li>')
        items.append(f"<li><strong>{html.escape(paper)}</strong>: of {len(judged)} claims judged on our runs, the "
                     f"rule decided {len(decided)}" + (f" ({html.escape(_counted(decided['category']))})"
                                                      if len(decided) else "")
                     + f"; {len(undecided)} undecided." + (f"<ul>{''.join(claims)}</ul>" if claims else "") + "</li>")
    return f'<ul class="headlines">{"".join(items)}</ul>'


def write(table: "pd.DataFrame", stem: str | Path) -> tuple[Path, Path]:
    """The table as ``<stem>.csv`` (runs as their cache keys) and ``<stem>.json`` (everything, runs in full)."""
    stem = Path(stem)
    csv, js = stem.with_suffix(".csv"), stem.with_suffix(".json")
    flat = table.copy()
    flat["runs"] = [" ".join(r["key"] for side in runs for r in side) for runs in table["runs"]]
    flat.to_csv(csv, index=False)
    js.write_text(json.dumps(table.to_dict(orient="records"), indent=1, sort_keys=True))
    return csv, js


def lock() -> str:
    """Every installed distribution but this project as ``name==version``, sorted by name: the exact
    environment of a build, for ``pip install -r``."""
    from importlib import metadata

    names = {d.metadata["Name"]: d.version for d in metadata.distributions()
             if d.metadata["Name"] and re.sub(r"[-_.]+", "-", d.metadata["Name"].lower()) != "fedlab-core"}
    return "".join(f"{n}=={v}\n" for n, v in sorted(names.items(), key=lambda kv: kv[0].lower()))


def stopping_replay(histories: Iterable["History"], patiences: Iterable[int] = (1, 2, 3, 4, 5, 6),
                    min_evaluations: int = 18) -> "pd.DataFrame":
    """The stop (:func:`fedlab_core.convergence.stop_round`) replayed on finished long runs, per patience.

    The runs: those that went to their last round (not stopped, not diverged) with at least `min_evaluations`
    evaluated rounds. The stop reads each run's validation curve where it monitored one, else its clients' test
    accuracy; the score (the mean of the last fifth of evaluations) reads the clients' test accuracy. Columns:
    the runs, how many the stop ends early, and among those the median of |score at the end - score at the
    stop| and the share above two points, in points."""
    import numpy as np
    import pandas as pd

    from .convergence import replay
    from .verdicts import convergence_curve, curve

    long = [h for h in histories if not h.meta.get("stopped_at_plateau") and not h.meta.get("diverged")
            and len(curve(h)) >= min_evaluations]
    rows = []
    for patience in patiences:
        gaps = []
        for h in long:
            at, gap = replay(convergence_curve(h), patience, score=curve(h))
            if at is not None:
                gaps.append(abs(100 * gap))
        rows.append({"patience": patience, "runs": len(long), "stopped early": len(gaps),
                     "median |end - stop| (points)": float(np.median(gaps)) if gaps else math.nan,
                     "share over 2 points": float(np.mean(np.array(gaps) > 2)) if gaps else math.nan})
    return pd.DataFrame(rows).set_index("patience")
