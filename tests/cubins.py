"""The GPU architectures a CUDA library's kernels are built for, read from its embedded fat binaries (the
`.nv_fatbin` payloads nvcc links in: a header with magic 0xBA55ED50, then one entry per kernel image, each naming
its kind, PTX or SASS, and its architecture, e.g. 80 for sm_80), as `cuobjdump --list-elf` lists them, without
the CUDA toolkit."""
import mmap
import struct

MAGIC = struct.pack("<I", 0xBA55ED50)
KINDS = {1: "ptx", 2: "sass"}


def fatbins(path) -> list[set[tuple[str, str]]]:
    """Each fat binary in the file: its images as {(kind, "8.0")}."""
    out = []
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        pos = m.find(MAGIC)
        while pos != -1:
            header_size, size = struct.unpack_from("<HQ", m, pos + 6)
            p, end, images = pos + header_size, pos + header_size + size, set()
            while p < end:
                kind, _, entry_size, payload = struct.unpack_from("<HHIQ", m, p)
                arch = struct.unpack_from("<I", m, p + 28)[0]
                images.add((KINDS.get(kind, str(kind)), f"{arch // 10}.{arch % 10}"))
                if not entry_size:
                    break
                p += entry_size + payload
            out.append(images)
            pos = m.find(MAGIC, max(end, pos + 4))
    return out


def built_for(path, share: float = 1.0) -> list[str]:
    """The architectures with a SASS image in at least `share` of the file's fat binaries (1.0: in every one),
    lowest first."""
    found = [{a for k, a in images if k == "sass"} for images in fatbins(path)]
    archs = {a for f in found for a in f}
    common = {a for a in archs if sum(a in f for f in found) >= share * len(found)} if found else set()
    return sorted(common, key=lambda a: tuple(map(int, a.split("."))))
