#!/usr/bin/env bash
# Everything that needs the GPU, in one call on the device machine:
#   NOVA_COMMIT=<sha> bash scripts/gpu_check.sh [tests [pytest args]|gpt2|bench|bench-gpt2|headline|ab|attn-dropout|attn-tf32|attn-tma|wide|tail|wave-tail|bench-gpt2-dp1|profile|gaps|ws|ws-epi|adamw|warm|tf32|tf32-tiles|ws-tf32|tf32-search|streamk|few-tiles|mm-stalls|wgmma-cost|launches|lce-rows|lm-head|variants|dram|stalls|rates|all] [options]
# Installs the carried wheels (.whl: xdsl and its two dependencies), runs the GPU
# tests, the GPT-2 124M step check and the matmul benchmark; logs and JSON go to $OUT.
set -uo pipefail
what=${1:-all}
OUT=${OUT:-/tmp/nova-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 NOVA_CACHE_DIR=/tmp/nova-cache
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/gpu.txt"
if [[ $what == tests || $what == all ]]; then
  # tests/kernels is the interpreter suite (CPU tensors, TRITON_INTERPRET=1): CI runs it, not the GPU.
  # tests [paths or -k ...]: a part of tests/gpu (the whole took 534 s at db6f021, near a call's 600 s)
  [[ $what == tests ]] && shift
  [[ $# -gt 0 ]] || set -- tests/gpu
  timeout 560 python3 -m pytest -q -s "$@" -p no:cacheprovider --durations=15 -rfE 2>&1 | tee "$OUT/gpu_tests.log" | tail -60
fi
if [[ $what == gpt2 || $what == all ]]; then
  for p in fp32 tf32; do
    timeout 240 python3 bench/gpt2_step.py --precision $p --steps 20 --out "$OUT" 2>&1 | tail -30
  done
fi
if [[ $what == bench-gpt2 ]]; then  # eager, torch.compile and Nova side by side: nova bench gpt2 [options]
  shift
  python3 -m nova.cli.main bench gpt2 --out "$OUT" "$@" 2>&1 | tail -40
fi
if [[ $what == headline ]]; then  # issue 9's three rows (the README's table), the three engines each: about 330 s
  shift
  timeout 200 python3 -m nova.cli.main bench gpt2 --out "$OUT" --model 124m --precision bf16 --batch 32 "$@" 2>&1 | tail -6
  timeout 190 python3 -m nova.cli.main bench gpt2 --out "$OUT" --model 124m --precision tf32 --batch 16 "$@" 2>&1 | tail -6
  timeout 130 python3 -m nova.cli.main bench gpt2 --out "$OUT" --model mlp46m --precision tf32 --batch 8 "$@" 2>&1 | tail -6
fi
if [[ $what == ab ]]; then  # Nova alone in variants, one after another in this process's machine:
  # AB="name:--set M.N=V ...|name2:..." (an empty list of sets is the default) over the bench gpt2 options given
  shift
  IFS='|' read -ra variants <<< "${AB:-default:}"
  for v in "${variants[@]}"; do
    echo "== ${v%%:*}"
    # shellcheck disable=SC2086  # the sets are words
    timeout 170 python3 -m nova.cli.main bench gpt2 --engines nova --out "$OUT/ab_${v%%:*}" ${v#*:} "$@" 2>&1 | tail -3
  done
  rm -f "$OUT"/ab_*/*.png
  (cd "$OUT" && dirs=$(ls -d ab_*/) && tar czf "ab_${AB_NAME:-run}.tgz" $dirs && rm -rf $dirs)
fi
if [[ $what == attn-dropout ]]; then  # SDPA's dropout_p and the int32 models (RoBERTa, BLOOM): the step tests against
  # the reference, then the dropout kernels' cost
  # beside SDPA's flash backend (scripts/attention_dropout.py)
  shift
  timeout 250 python3 -m pytest -q -s tests/gpu/test_triton_step.py tests/gpu/test_hf_models_gpu.py -k "dropout or roberta or bloom or mpt or t5" \
    -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests_dropout.log" | tail -4
  timeout 200 python3 scripts/attention_dropout.py --out "$OUT" "$@" 2>&1 | tail -12
fi
if [[ $what == attn-tf32 ]]; then  # the tf32 attention kernels over TF32_GRIDS, as they are and with q, k, v, dO
  # prerounded (scripts/attention_variants.py --precision tf32 [--prerounded]); GPT-2's batch 16 unless given
  shift
  for pre in "" --prerounded; do
    echo "== tf32 attention ${pre:-as is}"
    timeout 270 python3 scripts/attention_variants.py --precision tf32 $pre --batch 16 --source-flags --budget-s 200 \
      --out "$OUT" "$@" 2>&1 | tee -a "$OUT/attention_tf32.log" | sed -n '/sorted by kernel/,/summary/p' | head -60
  done
fi
if [[ $what == attn-tma ]]; then  # the TMA source flags (tma_kv, tma_bwd) beside the shipped pointer loads, at the
  # default schedules (then grid tiles for the rest of 45 s): bf16 at batch 32, tf32 at batch 16 (scripts/attention_variants.py)
  shift
  for p in "bf16 32" "tf32 16"; do
    set -- $p
    echo "== $1 attention, tma_kv and tma_bwd"
    timeout 200 python3 scripts/attention_variants.py --precision $1 --batch $2 --source-flags tma_kv tma_bwd --budget-s 45 \
      --out "$OUT" 2>&1 | tee -a "$OUT/attention_tma_kv.log" | sed -n '/sorted by kernel/,/summary/p' | head -30
  done
fi
if [[ $what == wide ]]; then  # 192-wide tiles and plain kernels beside Nova's launches and cuBLAS (scripts/matmul_wide.py)
  shift
  timeout 420 python3 scripts/matmul_wide.py --out "$OUT" "$@" 2>&1 | tee "$OUT/matmul_wide.log" | tail -130
fi
if [[ $what == tail ]]; then  # a grid's last partial wave as a second launch (scripts/matmul_tail.py)
  shift
  timeout 420 python3 scripts/matmul_tail.py --out "$OUT" "$@" 2>&1 | tee "$OUT/matmul_tail.log" | tail -80
fi
if [[ $what == wave-tail ]]; then  # configurator rule 8f (WAVE_TAIL) on and off: its GPU test, the step's bf16
  # matmuls at batch 8 and 32, then the bf16 steps (Nova alone) at batch 8 and 32
  shift
  timeout 150 python3 -m pytest -q tests/gpu/test_matmul_tail_gpu.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests_tail.log" | tail -3
  for v in on off; do
    sets=(); [[ $v == off ]] && sets=(--set schedule.configurator.WAVE_TAIL=False)
    for b in 8 32; do
      timeout 100 python3 -m nova.cli.main bench matmul --shapes gpt2 --batch $b --precisions bf16 --search-budget 0 \
        --out "$OUT/mm${b}_$v" "${sets[@]}" 2>&1 | tail -2
    done
  done
  for b in 8 32; do
    for v in on off on2; do
      sets=(); [[ $v == off ]] && sets=(--set schedule.configurator.WAVE_TAIL=False)
      echo "== step b$b tail $v"
      timeout 120 python3 -m nova.cli.main bench gpt2 --engines nova --model 124m --precision bf16 --batch $b \
        --out "$OUT/step${b}_$v" "${sets[@]}" "$@" 2>&1 | tail -2
    done
  done
  rm -f "$OUT"/mm*/*.png "$OUT"/step*/*.png
  (cd "$OUT" && tar czf wave_tail.tgz mm8_* mm32_* step8_* step32_* && rm -rf mm8_* mm32_* step8_* step32_*)
fi
if [[ $what == bench-gpt2-dp1 ]]; then  # the same under torchrun over one rank: DDP and Nova's data_parallel, no link crossed
  shift
  python3 -m torch.distributed.run --standalone --nproc-per-node=1 bench/gpt2.py --out "$OUT" "$@" 2>&1 | tail -40
fi
if [[ $what == profile ]]; then  # kernel time per step, Nova beside torch.compile, and the host time of a call
  shift
  timeout 400 python3 scripts/kernel_profile.py --out "$OUT" "$@" 2>&1 | tee "$OUT/kernel_profile.log" | tail -150
  # the host profile at the profile's batch (host_profile.py takes --batch, not the model options)
  hb=(); args=("$@")
  for i in "${!args[@]}"; do [[ ${args[$i]} == --batch ]] && hb=(--batch "${args[$((i + 1))]}"); done
  timeout 150 python3 scripts/host_profile.py --calls 20 "${hb[@]}" 2>&1 | tee "$OUT/host_profile.log" | head -45
fi
if [[ $what == gaps ]]; then  # the graph's kernels beside the launch list's, and the idle time between them (GPT-2 124M bf16)
  shift
  timeout 400 python3 scripts/graph_gaps.py --out "$OUT" "$@" 2>&1 | tee "$OUT/graph_gaps.log" | tail -80
fi
if [[ $what == ws ]]; then  # warp-specialized persistent matmuls beside cuBLAS (an experiment: scripts/matmul_ws.py)
  shift
  timeout 560 python3 scripts/matmul_ws.py --out "$OUT" "$@" 2>&1 | tee "$OUT/matmul_ws.log" | tail -60
fi
if [[ $what == ws-epi ]]; then  # the template's warp-specialized epilogues beside the unpartitioned kernel (NaN hunt)
  shift
  timeout 400 python3 scripts/matmul_ws.py --epilogues --limit 60 --out "$OUT" "$@" 2>&1 | tee "$OUT/matmul_ws_epilogues.log" | tail -40
fi
if [[ $what == adamw ]]; then  # a multi-tensor AdamW from a pointer table beside per-tensor launches (scripts/multi_tensor_adamw.py)
  shift
  timeout 200 python3 scripts/multi_tensor_adamw.py --out "$OUT" "$@" 2>&1 | tee "$OUT/multi_tensor_adamw.log" | tail -20
fi
if [[ $what == warm ]]; then  # the warm compile in a second process, GPT-2 124M bf16 at batch 8 and 32 (issue 8: < 5 s)
  shift
  for b in 8 32; do
    timeout 280 python3 scripts/warm_compile.py --device cuda --batch $b --out "$OUT" "$@" 2>&1 | tee "$OUT/warm_compile_b$b.log" | tail -80
  done
fi
if [[ $what == wgmma-cost ]]; then  # the warm compile without and with the post-compile wgmma check (NOVA_WGMMA_CHECK), tf32 2 layers
  shift
  for chk in 0 1; do
    NOVA_WGMMA_CHECK=$chk timeout 200 python3 scripts/warm_compile.py --device cuda --precision tf32 --batch 8 --layers 2 \
      --out "$OUT/wgmma_check_$chk" "$@" 2>&1 | tail -3
  done
fi
if [[ $what == tf32 ]]; then  # the tf32 steps' matmuls: cuBLAS, as run, operands pre-rounded, truncating; the 46M step's profile
  shift
  timeout 330 python3 scripts/tf32_variants.py --shapes-file bench/mlp46m_matmul_shapes.json \
    --shapes-file bench/gpt2_tf32_b16_matmul_shapes.json --out "$OUT" "$@" 2>&1 | tee "$OUT/tf32_variants.log" | tail -40
  timeout 200 python3 scripts/kernel_profile.py --model mlp46m --precision tf32 --batch 8 --out "$OUT" 2>&1 \
    | tee "$OUT/kernel_profile.log" | head -40
fi
if [[ $what == tf32-tiles ]]; then  # the 46M step's tf32 launches at other persistent tiles (TF32_TILES), both operands rounded
  shift
  tiles=(); for t in ${TF32_TILES:-pers:128x128x32:s4:w4 pers:128x128x32:s5:w4}; do tiles+=(--tile "$t"); done
  timeout 300 python3 scripts/tf32_variants.py --shapes-file bench/mlp46m_matmul_shapes.json "${tiles[@]}" \
    --out "$OUT/tf32_tiles" "$@" 2>&1 | tee "$OUT/tf32_tiles.log" | tail -40
fi
if [[ $what == ws-tf32 ]]; then  # rule 8b on the staged tf32 path (configurator.WS_TF32) off and on: its GPU test,
  # the tf32 steps' matmuls against cuBLAS, then the 46M MLP step (torch.compile and Nova)
  shift
  timeout 120 python3 -m pytest -q -s tests/gpu/test_matmul_ws_gpu.py -k tf32 -p no:cacheprovider 2>&1 | tail -4
  for v in off on; do
    sets=(); [[ $v == on ]] && sets=(--set schedule.configurator.WS_TF32=True)
    timeout 100 python3 -m nova.cli.main bench matmul --shapes gpt2 --shapes-file bench/mlp46m_matmul_shapes.json \
      --batch 8 --precisions tf32 --search-budget 0 --out "$OUT/wstf32_mm8_$v" "${sets[@]}" 2>&1 | tail -12
    timeout 120 python3 -m nova.cli.main bench gpt2 --out "$OUT/wstf32_mlp_$v" --model mlp46m --precision tf32 --batch 8 \
      --engines torch.compile,nova "${sets[@]}" "$@" 2>&1 | tail -4
  done
  rm -f "$OUT"/wstf32_*/*.png
  (cd "$OUT" && dirs=$(ls -d wstf32_*/) && tar czf ws_tf32.tgz $dirs && rm -rf $dirs)
fi
if [[ $what == tf32-search ]]; then  # nova bench matmul's search on the tf32 steps' launches (46M b8, GPT-2 b16)
  shift
  timeout 250 python3 -m nova.cli.main bench matmul --shapes gpt2 --shapes-file bench/mlp46m_matmul_shapes.json \
    --batch 8 --precisions tf32 --search-budget 24 --out "$OUT/mlp46m" "$@" 2>&1 | tail -30
  timeout 300 python3 -m nova.cli.main bench matmul --shapes gpt2 --shapes-file bench/gpt2_tf32_b16_matmul_shapes.json \
    --batch 16 --precisions tf32 --search-budget 24 --out "$OUT/gpt2_b16" "$@" 2>&1 | tail -30
fi
if [[ $what == streamk ]]; then  # configurator rule 5c (stream-K in the split model) off and on: the matmuls, then the tf32 step
  shift
  for v in off on; do
    sets=(); [[ $v == off ]] && sets=(--set schedule.configurator.STREAM_K_TILES=False)
    timeout 120 python3 -m nova.cli.main bench matmul --shapes gpt2 --shapes-file bench/gpt2_tf32_b16_matmul_shapes.json \
      --batch 16 --precisions tf32 --search-budget 0 --out "$OUT/mm16_$v" "${sets[@]}" 2>&1 | grep -E "x768|x2304|x32768|x16384|wrote" | head -20
    timeout 150 python3 -m nova.cli.main bench matmul --shapes gpt2 --batch 32 --precisions bf16,tf32 --search-budget 0 \
      --out "$OUT/mm32_$v" "${sets[@]}" 2>&1 | tail -3
  done
  for v in off on; do  # STREAMK_STEPS=0: the matmuls only
    [[ ${STREAMK_STEPS:-1} == 0 ]] && break
    sets=(); [[ $v == off ]] && sets=(--set schedule.configurator.STREAM_K_TILES=False)
    timeout 150 python3 -m nova.cli.main bench gpt2 --out "$OUT/steps" --model 124m --precision tf32 --batch 16 \
      --engines torch.compile,nova "${sets[@]}" "$@" 2>&1 | tail -4
  done
  rm -f "$OUT"/mm*/*.png
  (cd "$OUT" && tar czf streamk.tgz mm16_* mm32_* $(ls -d steps 2>/dev/null) && rm -rf mm16_* mm32_* steps)
fi
if [[ $what == few-tiles ]]; then  # bf16 batch 8's few-tile launches (768-wide outputs): the configured kernels, then
  # warp specialization from one tile a program (WS_MIN_TILES_PER_SM=1), its 128x128 tile too, and stream-K forced
  shift
  for v in ${FEW_VARIANTS:-default ws1 ws128 sk}; do
    case $v in
      default) sets=() ;;
      ws1) sets=(--set schedule.configurator.WS_MIN_TILES_PER_SM=1.0) ;;
      ws128) sets=(--set schedule.configurator.WS_MIN_TILES_PER_SM=1.0
                   --set "schedule.configurator.WS_TILES={'plain': (128, 128, 4), 'epilogue': (128, 256, 4)}") ;;
      sk) sets=(--set schedule.configurator.STREAM_K_MIN_GAIN=-0.5) ;;
      wsfull) sets=(--set schedule.configurator.WS_HALF_TILE=False) ;;
    esac
    echo "== $v"
    timeout 120 python3 -m nova.cli.main bench matmul --shapes gpt2 --batch 8 --precisions bf16 --search-budget 0 \
      --out "$OUT/few_$v" "${sets[@]}" "$@" 2>&1 | tail -17
  done
  rm -f "$OUT"/few_*/*.png
  (cd "$OUT" && dirs=$(ls -d few_*/) && tar czf fewtiles.tgz $dirs && rm -rf $dirs)
fi
if [[ $what == launches ]]; then  # every launch of a step measured (step.profile), by kind: scripts/step_launches.py [options]
  shift
  timeout 300 python3 scripts/step_launches.py --out "$OUT" "$@" 2>&1 | tee -a "$OUT/step_launches.log" | tail -90
fi
if [[ $what == lce-rows ]]; then  # the LM head's row kernel in its variants (scripts/lce_rows_variants.py)
  shift
  timeout 200 python3 scripts/lce_rows_variants.py --out "$OUT" "$@" 2>&1 | tee "$OUT/lce_rows_variants.log" | tail -30
fi
if [[ $what == lm-head ]]; then  # the LM head's parts of one chunk timed alone, the row statistics' too (scripts/lm_head_parts.py)
  shift
  timeout 400 python3 scripts/lm_head_parts.py --chunks 4096 --dh-split 1 --out "$OUT" "$@" 2>&1 | tee "$OUT/lm_head_parts.log" | tail -30
fi
if [[ $what == variants ]]; then  # the 12-layer bf16 step's CUDA graph in variants (scripts/epilogue_variants.py --graph)
  shift
  timeout 560 python3 scripts/epilogue_variants.py --graph --layers 12 --out "$OUT" "$@" 2>&1 | tee "$OUT/epilogue_variants.log" | tail -60
fi
if [[ $what == dram ]]; then  # DRAM and L2 bytes per kernel from ncu's counters, Nova beside torch.compile (scripts/dram_bytes.py)
  shift
  timeout 560 python3 scripts/dram_bytes.py --out "$OUT" "$@" 2>&1 | tee "$OUT/dram_bytes.log" | tail -70
fi
if [[ $what == stalls ]]; then  # warp stall reasons of the kernels matching a regex (scripts/dram_bytes.py --stalls)
  shift
  timeout 560 python3 scripts/dram_bytes.py --out "$OUT" --engines nova --stalls "$@" 2>&1 | tee "$OUT/stalls.log" | tail -80
fi
if [[ $what == mm-stalls ]]; then  # warp stall reasons of single matmuls, Nova's configured launch beside cuBLAS's
  # (scripts/dram_bytes.py --stalls with matmul engines): tf32 forwards at K = 768 / 384 and bf16 batch 8's 768-wide ones
  shift
  engines=${MM_STALLS:-"matmul:16384,2304,768,tf32,row,col,ab;matmul:8192,1536,384,tf32,row,col,ab;matmul:8192,768,3072,bf16,row,col;matmul:8192,768,3072,bf16,row,row;matmul:8192,768,768,bf16,row,col"}
  timeout 560 python3 scripts/dram_bytes.py --stalls '.*' --launches 3 --engines "$engines" --timeout 100 --out "$OUT/mm_stalls" "$@" \
    2>&1 | tee "$OUT/mm_stalls.log" | tail -80
  (cd "$OUT" && tar czf mm_stalls.tgz mm_stalls && rm -rf mm_stalls)
fi
if [[ $what == rates ]]; then  # copy bandwidth and cuBLAS bf16 / tf32 GEMM rates of this GPU (scripts/device_rates.py)
  shift
  timeout 200 python3 scripts/device_rates.py --out "$OUT" "$@" 2>&1 | tee "$OUT/device_rates.log" | tail -10
fi
if [[ $what == bench ]]; then
  shift
  python3 -m nova.cli.main bench matmul --out "$OUT" "$@" 2>&1 | tail -40
fi
