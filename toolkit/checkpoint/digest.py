"""Each file's size and SHA-256, recorded when a checkpoint is committed and compared before it is read.

Why: verify.py finds a file that is missing or too short from DCP's `.metadata`, but a file of the right size
whose bytes changed after the save (bit rot, a bad copy) loads as other weights without a word, or fails deep
inside torch. `digests.json` lists every file of the checkpoint folder (the DCP shards and `.metadata`, the
manifest, recipe.yaml, hf/) with its size and digest; a reader compares the sizes first (free), then the digests.

Rank 0 records them at the commit, when every rank's files are on disk: the commit already needs every rank's
files in the one folder it renames (output_dir is on storage every node sees), so one process sees them all.
Reading them back is shared: each rank hashes its share of the files and every rank gets the first problem any
found, so that all of them stop with the same line. One pass over the bytes either way, nothing printed per file.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from toolkit.atomic import write_text_whole
from toolkit.errors import RecipeError
from toolkit.process.dist import DistEnv, gather_objects

DIGESTS = "digests.json"
# sha256: with the CPU's SHA instructions it hashed 1.5 GB/s from the page cache on the development machine,
# blake2b 0.9 GB/s; and `sha256sum FILE` checks an entry by hand
ALGORITHM = "sha256"
CHUNK_BYTES = 1 << 20
AGAIN = "copy the whole folder again, or use an earlier checkpoint"


def file_digest(path: Path) -> str:
    """The file's SHA-256, read in 1 MiB chunks into one buffer (hashlib releases the GIL while it hashes one)."""
    digest = hashlib.new(ALGORITHM)
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while size := handle.readinto(buffer):
            digest.update(view[:size])
    return digest.hexdigest()


def record(folder: Path) -> None:
    """Rank 0, once the checkpoint's files and manifest are written: digests.json, written whole, listing every
    other file of `folder`. Files are hashed on a few threads: the commit of a large checkpoint waits for them."""
    names = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                   if p.is_file() and p.name != DIGESTS)
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        digests = list(pool.map(lambda name: file_digest(folder / name), names))
    files = {name: {"bytes": (folder / name).stat().st_size, ALGORITHM: value} for name, value in zip(names, digests)}
    write_text_whole(folder / DIGESTS, json.dumps({"algorithm": ALGORITHM, "files": files}, indent=1), durable=True)


def listed(folder: Path, *, expected: bool) -> dict[str, dict] | None:
    """The files digests.json lists (name -> {"bytes", "sha256"}). None where there is none and `expected` is
    False: a checkpoint written before digests were recorded is read as before, checked by verify.py alone."""
    path = folder / DIGESTS
    if not path.is_file():
        if expected:  # the manifest says the save recorded them: a copy that lost the file could hide others
            raise RecipeError(f"checkpoint {folder} is incomplete: its {DIGESTS}, named in its manifest.json, is "
                              f"missing; {AGAIN}")
        return None
    try:
        data = json.loads(path.read_text())
        files = data["files"]
        if data.get("algorithm") != ALGORITHM or not all(
                isinstance(e, dict) and isinstance(e.get("bytes"), int) and isinstance(e.get(ALGORITHM), str)
                and not Path(n).is_absolute() and ".." not in Path(n).parts for n, e in files.items()):
            raise ValueError("not a list of the folder's files with sizes and digests")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise RecipeError(f"checkpoint {folder}: its {DIGESTS} is unreadable ({type(exc).__name__}); the "
                          f"checkpoint is corrupted, {AGAIN}") from None
    return files


def check(folder: Path, *, expected: bool, env: DistEnv | None = None) -> None:
    """Every file digests.json lists has its recorded size and bytes; RecipeError (one line, naming the first
    file that differs) otherwise. Collective with `env`: each rank hashes its share, all raise alike."""
    files = listed(folder, expected=expected)
    if files is None:
        return
    rank, world_size = (env.rank, env.world_size) if env is not None else (0, 1)
    problems = [p for p in (_size_problem(folder, n, files[n]) for n in sorted(files)) if p]  # before any hashing
    if not problems:
        share = _share(files, rank=rank, world_size=world_size)
        problems = [p for p in (_bytes_problem(folder, n, files[n]) for n in share) if p]
    every = gather_objects(problems[:1], env) if env is not None else [problems[:1]]
    found = sorted(p for of_rank in every for p in of_rank)  # the first by file name, whichever rank hashed it
    if found:
        raise RecipeError(found[0][1])


def _size_problem(folder: Path, name: str, entry: dict) -> tuple[str, str] | None:
    file = folder / name
    if not file.is_file():
        return name, f"checkpoint {folder} is incomplete: its file {name}, listed in its {DIGESTS}, is missing; {AGAIN}"
    size = file.stat().st_size
    if size != entry["bytes"]:
        return name, (f"checkpoint {folder} is damaged: its file {name} has {size} bytes, it was saved with "
                      f"{entry['bytes']}; {AGAIN}")
    return None


def _bytes_problem(folder: Path, name: str, entry: dict) -> tuple[str, str] | None:
    try:
        if file_digest(folder / name) == entry[ALGORITHM]:
            return None
    except OSError as exc:  # returned, not raised: the other ranks wait for this one's answer
        return name, f"checkpoint {folder}: its file {name} is unreadable ({exc.strerror}); {AGAIN}"
    return name, (f"checkpoint {folder} is damaged: its file {name} does not hold the bytes it was saved with "
                  f"(its {ALGORITHM} differs from {DIGESTS}); {AGAIN}")


def _share(files: dict[str, dict], *, rank: int, world_size: int) -> list[str]:
    """This rank's files to hash: the largest first, each to the rank with the fewest bytes so far, so that the
    ranks finish together (under ZeRO rank 0 wrote every shard). Every rank computes the same split."""
    loads = [0] * world_size
    mine = []
    for name in sorted(files, key=lambda n: (-files[n]["bytes"], n)):
        least = loads.index(min(loads))
        loads[least] += files[name]["bytes"]
        if least == rank:
            mine.append(name)
    return mine
