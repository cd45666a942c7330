#!/usr/bin/env bash
# Session 7, issue 4: why KernelSpec.dynamic lost 1-3 % (s7dyn). One H200 call, one process per variant of the
# dynamic block order (FG_DYN_VARIANT prefixed to the source): 0 thread 0 takes a block per iteration and
# waits for it an iteration later (as committed), 1 blocks split, split + S, ... with no counter (the
# order alone), 2 the warps take turns at the counter (each waits NW iterations). ab_decode: static vs
# dynamic tile, cuDNN in the same rounds (3). 3: the counter taken and published as 0 but the blocks of 1;
# 4: no counter, the blocks of 1 read back from the ring as 0 reads them. One tarball: $OUT/s7var.tgz.
. bench/device_lib.sh
device_setup s7var
for v in ${VARIANTS:-0 1 2}; do
  timeout 150 python3 bench/decode_probe.py variant $v "n128w4s2h2,n128w4s2h2d" "$W/var$v.json" > "$W/var$v.log" 2>&1
  echo "rc=$?" >> "$W/var$v.log"; echo "== variant $v"; grep -E "L32768|L131072|L4096_bhsd.*full|all |rc=" "$W/var$v.log"; pack
done
