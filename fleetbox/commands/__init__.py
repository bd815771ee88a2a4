"""The tasks whose work spans several parts (`up`, `verify`, `doctor`, `train`, `scale`, `jobs`, `logs`, `cancel`,
`report`). Tasks whose work lies in one part (lock, wheels, base, build, cache, export, push, kit, clean) call
that part directly from tasks.py."""
