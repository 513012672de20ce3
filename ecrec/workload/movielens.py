"""MovieLens-100k as click data for the DLRM workload: real interactions, a laptop-sized table set.

A rating >= 4 is a click (label 1).  Each rating becomes one sample with

- categorical features (one id per table, row 0 = missing, other rows in the
  sorted order of the raw values): ``user``, ``item``, ``age`` bucket,
  ``gender``, ``occupation``, ``zip3`` (first three characters of the zip
  code), ``decade`` (of the movie's release), ``genre1`` and ``genre2`` (the
  movie's first two genres in the canonical MovieLens order);
- 13 integer dense features, ``log1p`` transformed like Criteo's: hour of day,
  day of week, days since the first rating in the data, movie age in years at
  rating time, number of genres, user age, padded with zeros to 13.

:func:`load_movielens` returns arrays (an ``InMemoryDataset`` via
``.dataset()``); :func:`write_movielens_tsv` writes the same samples as a
Criteo-format TSV (ids as hex), which ``CriteoReader`` reads back to the same
arrays.  Both RecBole's atomic files (``ml-100k.inter/.user/.item``, what the
recbole wheel ships) and GroupLens' original ``u.data/u.user/u.item`` are read.

Getting the data: ``python -m ecrec.workload.movielens fetch [--dest DIR]``
downloads the recbole wheel from PyPI with ``pip download`` (no other network)
and extracts ``recbole/dataset_example/ml-100k/`` from it; ``--wheel PATH``
extracts from a wheel you already have.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ecrec.workload.criteo import CriteoReader
from ecrec.workload.data import InMemoryDataset

RECBOLE_VERSION = "1.2.1"
WHEEL_DIR = "recbole/dataset_example/ml-100k/"
ATOMIC_FILES = ("ml-100k.inter", "ml-100k.user", "ml-100k.item")
GROUPLENS_FILES = ("u.data", "u.user", "u.item")
NUM_DENSE = 13
GENRES = ("unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime", "Documentary", "Drama",
          "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery", "Romance", "Sci-Fi", "Thriller", "War", "Western")
TABLE_NAMES = ("user", "item", "age", "gender", "occupation", "zip3", "decade", "genre1", "genre2")
DENSE_NAMES = ("hour", "weekday", "day", "movie_age", "num_genres", "user_age")
_AGE_BUCKETS = (18, 25, 35, 45, 50, 56)  # MovieLens-1M's: <18, 18-24, ..., 56+


def default_dir() -> Path:
    """Where ``fetch`` puts the files by default: ``$ECREC_DATA/ml-100k`` or ``~/.cache/ecrec/ml-100k``."""
    base = os.environ.get("ECREC_DATA") or os.path.join(os.path.expanduser("~"), ".cache", "ecrec")
    return Path(base) / "ml-100k"


def _has_files(d: Path) -> str | None:
    if all((d / f).is_file() for f in ATOMIC_FILES):
        return "atomic"
    if all((d / f).is_file() for f in GROUPLENS_FILES):
        return "grouplens"
    return None


def find_ml100k(path: str | os.PathLike | None = None) -> Path:
    """The directory holding the ml-100k files (RecBole atomic or GroupLens original).

    Looks in ``path`` (or its ``ml-100k`` subdirectory) when given; otherwise in
    :func:`default_dir`, then in an installed recbole package.
    """
    candidates: list[Path] = []
    if path is not None:
        p = Path(path)
        candidates += [p, p / "ml-100k"]
    else:
        candidates.append(default_dir())
        try:
            import importlib.util

            spec = importlib.util.find_spec("recbole")
            if spec is not None and spec.submodule_search_locations:
                for loc in spec.submodule_search_locations:
                    candidates.append(Path(loc) / "dataset_example" / "ml-100k")
        except (ImportError, ValueError):
            pass
    for c in candidates:
        if c.is_dir() and _has_files(c):
            return c
    where = ", ".join(str(c) for c in candidates)
    raise FileNotFoundError(
        f"MovieLens-100k not found (looked in {where}); expected {', '.join(ATOMIC_FILES)} or "
        f"{', '.join(GROUPLENS_FILES)}. Run `python -m ecrec.workload.movielens fetch` to get it.")


# --- reading -------------------------------------------------------------------------------------

@dataclass
class _Raw:
    user: np.ndarray        # str tokens (n,)
    item: np.ndarray
    rating: np.ndarray      # float (n,)
    timestamp: np.ndarray   # int64 (n,)
    users: dict             # user token -> (age str, gender, occupation, zip)
    items: dict             # item token -> (release year int or None, genres list)


def _read_atomic_table(path: Path, encoding: str = "utf-8") -> tuple[list[str], list[list[str]]]:
    with open(path, encoding=encoding, errors="replace") as f:
        header = f.readline().rstrip("\r\n").split("\t")
        names = [h.split(":", 1)[0] for h in header]
        rows = [line.rstrip("\r\n").split("\t") for line in f if line.strip()]
    return names, rows


def _column(names: list[str], rows: list[list[str]], name: str, path: Path) -> list[str]:
    if name not in names:
        raise ValueError(f"{path}: no column {name!r} in header {names}")
    k = names.index(name)
    return [r[k] if k < len(r) else "" for r in rows]


def _read_atomic(d: Path) -> _Raw:
    p = d / "ml-100k.inter"
    names, rows = _read_atomic_table(p)
    try:
        rating = np.array(_column(names, rows, "rating", p), dtype=np.float64)
        ts = np.array([float(x) for x in _column(names, rows, "timestamp", p)], dtype=np.float64).astype(np.int64)
    except ValueError as exc:
        raise ValueError(f"{p}: bad rating or timestamp ({exc})") from None
    user = np.array(_column(names, rows, "user_id", p), dtype=object)
    item = np.array(_column(names, rows, "item_id", p), dtype=object)
    pu = d / "ml-100k.user"
    un, ur = _read_atomic_table(pu)
    users = {u: (a, g, o, z) for u, a, g, o, z in zip(*(_column(un, ur, c, pu) for c in
                                                          ("user_id", "age", "gender", "occupation", "zip_code")))}
    pi = d / "ml-100k.item"
    inames, irows = _read_atomic_table(pi)
    items = {}
    for i, year, cls in zip(*(_column(inames, irows, c, pi) for c in ("item_id", "release_year", "class"))):
        items[i] = (int(year) if year.strip().isdigit() else None, [g for g in cls.split() if g])
    return _Raw(user, item, rating, ts, users, items)


def _read_grouplens(d: Path) -> _Raw:
    p = d / "u.data"
    data = np.loadtxt(p, dtype=np.int64, ndmin=2)
    if data.shape[1] != 4:
        raise ValueError(f"{p}: expected 4 columns (user, item, rating, timestamp), got {data.shape[1]}")
    user = np.array([str(u) for u in data[:, 0]], dtype=object)
    item = np.array([str(i) for i in data[:, 1]], dtype=object)
    users = {}
    with open(d / "u.user", encoding="latin-1") as f:
        for line in f:
            parts = line.rstrip("\r\n").split("|")
            if len(parts) >= 5:
                users[parts[0]] = (parts[1], parts[2], parts[3], parts[4])
    items = {}
    with open(d / "u.item", encoding="latin-1") as f:
        for line in f:
            parts = line.rstrip("\r\n").split("|")
            if len(parts) < 5 + len(GENRES):
                continue
            date = parts[2].strip()
            year = int(date[-4:]) if len(date) >= 4 and date[-4:].isdigit() else None
            flags = parts[5:5 + len(GENRES)]
            items[parts[0]] = (year, [g for g, f in zip(GENRES, flags) if f.strip() == "1"])
    return _Raw(user, item, data[:, 2].astype(np.float64), data[:, 3], users, items)


def _sort_key(tok: str):
    return (0, int(tok), "") if tok.isdigit() else (1, 0, tok)


def _encode(tokens: list) -> tuple[np.ndarray, int]:
    """Ids 1..V in sorted order of the distinct tokens, 0 for ``None``/empty; returns (ids, V + 1)."""
    vocab = sorted({t for t in tokens if t not in (None, "")}, key=_sort_key)
    index = {t: k + 1 for k, t in enumerate(vocab)}
    return np.array([index.get(t, 0) if t not in (None, "") else 0 for t in tokens], dtype=np.int64), len(vocab) + 1


def _age_bucket(age: str) -> str | None:
    if not age.strip().isdigit():
        return None
    a = int(age)
    return str(sum(a >= b for b in _AGE_BUCKETS))


@dataclass
class MovieLensData:
    """MovieLens-100k as model inputs; ``dense_raw`` are the integer features before ``log1p``."""

    dense: np.ndarray        # float32 (N, 13): log1p(dense_raw)
    dense_raw: np.ndarray    # int64 (N, 13)
    ids: np.ndarray          # int64 (N, len(TABLE_NAMES))
    labels: np.ndarray       # float32 (N,)
    table_sizes: list[int]
    table_names: tuple[str, ...] = TABLE_NAMES
    dense_names: tuple[str, ...] = DENSE_NAMES
    source: str = ""

    def __len__(self) -> int:
        return int(self.labels.size)

    def dataset(self) -> InMemoryDataset:
        return InMemoryDataset(self.dense, self.ids, self.labels, self.table_sizes)


def load_movielens(path: str | os.PathLike | None = None, click_threshold: float = 4.0) -> MovieLensData:
    """Reads ml-100k (see :func:`find_ml100k`) into arrays, in the file's rating order."""
    d = find_ml100k(path)
    raw = _read_atomic(d) if _has_files(d) == "atomic" else _read_grouplens(d)
    n = raw.rating.size
    if n == 0:
        raise ValueError(f"{d}: no ratings")
    labels = (raw.rating >= click_threshold).astype(np.float32)
    user_info = [raw.users.get(u, ("", "", "", "")) for u in raw.user]
    item_info = [raw.items.get(i, (None, [])) for i in raw.item]
    order = {g: k for k, g in enumerate(GENRES)}
    genres = [sorted(g, key=lambda x: order.get(x, len(GENRES))) for _, g in item_info]
    columns = [
        list(raw.user), list(raw.item),
        [_age_bucket(a) for a, _, _, _ in user_info],
        [g or None for _, g, _, _ in user_info],
        [o or None for _, _, o, _ in user_info],
        [z[:3] if z else None for _, _, _, z in user_info],
        [str(y // 10 * 10) if y is not None else None for y, _ in item_info],
        [g[0] if len(g) > 0 else None for g in genres],
        [g[1] if len(g) > 1 else None for g in genres],
    ]
    encoded = [_encode(c) for c in columns]
    ids = np.stack([e for e, _ in encoded], axis=1)
    table_sizes = [size for _, size in encoded]

    ts = raw.timestamp
    days = ts // 86400
    rating_year = ts.astype("datetime64[s]").astype("datetime64[Y]").astype(np.int64) + 1970
    release = np.array([y if y is not None else -1 for y, _ in item_info], dtype=np.int64)
    dense_raw = np.zeros((n, NUM_DENSE), dtype=np.int64)
    dense_raw[:, 0] = (ts // 3600) % 24
    dense_raw[:, 1] = (days + 3) % 7  # 1970-01-01 was a Thursday: 0 = Monday
    dense_raw[:, 2] = days - days.min()
    dense_raw[:, 3] = np.where(release >= 0, np.maximum(rating_year - release, 0), 0)
    dense_raw[:, 4] = [len(g) for g in genres]
    dense_raw[:, 5] = [int(a) if a.strip().isdigit() else 0 for a, _, _, _ in user_info]
    dense = np.log1p(dense_raw.astype(np.float64)).astype(np.float32)
    return MovieLensData(dense=dense, dense_raw=dense_raw, ids=ids, labels=labels, table_sizes=table_sizes,
                         source=str(d))


def write_movielens_tsv(out_path: str | os.PathLike, path: str | os.PathLike | None = None,
                        click_threshold: float = 4.0) -> MovieLensData:
    """Writes ml-100k as a Criteo-format TSV (13 integer, ``len(TABLE_NAMES)`` hex columns).

    Read it back with ``CriteoReader(out_path, data.table_sizes, num_sparse=len(TABLE_NAMES))``.
    """
    data = load_movielens(path, click_threshold)
    cols = [data.labels.astype(np.int64).astype(str).tolist()]
    cols += [data.dense_raw[:, j].astype(str).tolist() for j in range(NUM_DENSE)]
    cols += [["" if v == 0 else f"{v:x}" for v in data.ids[:, t].tolist()] for t in range(data.ids.shape[1])]
    out_path = os.fspath(out_path)
    with open(out_path, "w", encoding="ascii", newline="\n") as f:
        f.write("\n".join(map("\t".join, zip(*cols))))
        f.write("\n")
    return data


def read_movielens_tsv(tsv_path: str | os.PathLike, table_sizes: list[int], **kwargs) -> CriteoReader:
    """A :class:`CriteoReader` for a TSV written by :func:`write_movielens_tsv`."""
    return CriteoReader(tsv_path, table_sizes, num_dense=NUM_DENSE, num_sparse=len(TABLE_NAMES), **kwargs)


# --- fetching --------------------------------------------------------------------------------------

def extract_from_wheel(wheel: str | os.PathLike, dest: str | os.PathLike) -> list[Path]:
    """Extracts the ml-100k atomic files (``.inter``, ``.user``, ``.item``) from a recbole wheel into ``dest``."""
    dest = Path(dest)
    try:
        zf = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as exc:
        raise RuntimeError(f"{wheel}: not a readable wheel ({exc})") from None
    written = []
    with zf:
        members = {Path(m).name: m for m in zf.namelist() if m.startswith(WHEEL_DIR)}
        missing = [f for f in ATOMIC_FILES if f not in members]
        if missing:
            raise RuntimeError(f"{wheel} has no {', '.join(WHEEL_DIR + f for f in missing)}")
        dest.mkdir(parents=True, exist_ok=True)
        for name in ATOMIC_FILES:
            target = dest / name
            tmp = target.with_suffix(target.suffix + ".part")
            with zf.open(members[name]) as src, open(tmp, "wb") as out:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
            os.replace(tmp, target)
            written.append(target)
    return written


def fetch(dest: str | os.PathLike | None = None, version: str = RECBOLE_VERSION, wheel: str | None = None,
          timeout_s: float = 300.0) -> Path:
    """Puts the ml-100k files in ``dest`` (default :func:`default_dir`) from the recbole wheel; returns ``dest``.

    Without ``wheel``, runs ``pip download recbole==VERSION --no-deps`` into a
    temporary directory (PyPI is the only network access).
    """
    dest = Path(dest) if dest is not None else default_dir()
    if wheel is not None:
        extract_from_wheel(wheel, dest)
        return dest
    with tempfile.TemporaryDirectory(prefix="ecrec-recbole-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", f"recbole=={version}", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-d", tmp]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except FileNotFoundError:
            raise RuntimeError(f"cannot run {sys.executable} -m pip") from None
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"`pip download recbole=={version}` did not finish in {timeout_s:.0f} s "
                               "(is PyPI reachable?)") from None
        if proc.returncode != 0:
            detail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            hint = ("pip is not installed in this Python" if "No module named pip" in (proc.stderr or "")
                    else "is PyPI reachable? Offline, download the wheel elsewhere and pass --wheel PATH")
            raise RuntimeError(f"`pip download recbole=={version} --no-deps` failed (exit {proc.returncode}; {hint}):\n  "
                               + "\n  ".join(detail))
        wheels = sorted(Path(tmp).glob("recbole-*.whl"))
        if not wheels:
            raise RuntimeError(f"pip download left no recbole wheel in {tmp}")
        extract_from_wheel(wheels[0], dest)
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ecrec.workload.movielens",
                                     description="MovieLens-100k for the ECRec DLRM workload.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("fetch", help="download the recbole wheel from PyPI and extract ml-100k from it")
    p.add_argument("--dest", default=None, help=f"directory for the files (default {default_dir()})")
    p.add_argument("--version", default=RECBOLE_VERSION, help="recbole version whose wheel to download")
    p.add_argument("--wheel", default=None, help="extract from this local recbole wheel instead of downloading")
    p = sub.add_parser("convert", help="write ml-100k as a Criteo-format TSV")
    p.add_argument("out", help="TSV file to write")
    p.add_argument("--src", default=None, help="directory with the ml-100k files (default: search)")
    p = sub.add_parser("info", help="summarize the ml-100k files found")
    p.add_argument("--src", default=None)
    args = parser.parse_args(argv)
    try:
        if args.command == "fetch":
            dest = fetch(args.dest, args.version, args.wheel)
            print(f"ml-100k files in {dest}")
        elif args.command == "convert":
            data = write_movielens_tsv(args.out, args.src)
            print(f"wrote {len(data)} samples to {args.out}; table_sizes={data.table_sizes}")
        else:
            data = load_movielens(args.src)
            print(f"{data.source}: {len(data)} ratings, click rate {data.labels.mean():.3f}")
            for name, size in zip(data.table_names, data.table_sizes):
                print(f"  {name:<11} {size:>6} rows")
    except (RuntimeError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
