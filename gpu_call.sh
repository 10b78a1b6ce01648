#!/usr/bin/env bash
# one device call of this session (not committed)
W=$OUT/w; mkdir -p $W; export PYTHONPATH=$PWD
uname -r; ldd --version | head -1; cat /sys/kernel/mm/transparent_hugepage/enabled
S="--model=qwen3-30b-a3b --batch=8 --seq=2048 --warmup=2 --steps=5 --cases=zero3-offload"
for kv in vocab_size=151936 hidden_size=2048 num_layers=12 num_heads=32 num_kv_heads=4 head_size=128 tie_embeddings=false num_experts=64 num_experts_per_tok=8 moe_intermediate_size=768 norm_topk_prob=true; do S="$S --set=model.$kv"; done
(while true; do grep -E "AnonHugePages" /proc/meminfo | tr '\n' ' '; date +%T; sleep 5; done) > $W/thp.log &
for v in a:- b:glibc.malloc.hugetlb=1 c:- d:glibc.malloc.hugetlb=1; do
  n=${v%%:*}; t=${v#*:}; [ "$t" = "-" ] && t=
  mkdir -p $W/$n; echo "== $n GLIBC_TUNABLES=$t $(date +%T)" >> $W/thp.log
  GLIBC_TUNABLES=$t timeout 100 python3 scripts/bench_offload.py $S --out=$W/$n > $W/$n.log 2>&1; echo "$n [$t] rc=$?"
  grep "^zero3-offload " $W/$n.log | head -1; grep "per step" $W/$n.log
done
grep -c . $W/thp.log; sort -t: -k2 -n $W/thp.log | tail -3
cd $OUT && tar czf logs.tgz w && rm -rf w
