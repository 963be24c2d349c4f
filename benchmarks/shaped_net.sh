#!/usr/bin/env bash
# A shaped test network on one machine, for the link-speed benchmarks (never CI).
#
# P "hosts" are network namespaces obn0..obn{P-1} (addresses 10.201.0.1..P) on one
# bridge; each host's egress is limited to RATE by a tbf qdisc, so traffic between
# hosts crosses a slow link while the ranks inside one host talk over its own
# loopback, unshaped, like GPUs inside one node.
#
#   benchmarks/shaped_net.sh run P RATE -- CMD...   start CMD once per rank with the
#       torchrun variables set (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
#       MASTER_ADDR, MASTER_PORT) plus GLOO_SOCKET_IFNAME; wait for every rank; exit
#       with the first failure's status. The network is removed on every exit,
#       Ctrl-C and kill included.
#   benchmarks/shaped_net.sh up P RATE              build the network and leave it
#   benchmarks/shaped_net.sh down P                 remove it
#
# One network at a time: a second run while one holds it fails at once (it would
# share the bridge and addresses). Every build first removes what a run killed
# with SIGKILL left behind, whatever its P, since a leftover bridge or namespace
# would shape the next run.
#
# RATE: a tc rate (1gbit, 100mbit, ...) or `none` for an unshaped link.
# PER_HOST=K starts K ranks on each host (RANK = host*K + local rank).
# Needs root (network namespaces), iproute2 and tc. Example:
#
#   sudo PER_HOST=2 benchmarks/shaped_net.sh run 2 100mbit -- .venv/bin/python -m onebit.bench
set -u

PREFIX=obn   # namespaces obn<i>, veths obnv<i>/obnh<i>, bridge obnbr

usage() {
  sed -n '2,26p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

need_root_and_tools() {
  if [ "$(id -u)" != 0 ]; then
    echo "shaped_net.sh: needs root to create network namespaces and shape links;" \
         "run it with sudo (it changes nothing else on the machine)" >&2
    exit 1
  fi
  for tool in ip tc; do
    command -v "$tool" >/dev/null || { echo "shaped_net.sh: '$tool' not found (install iproute2)" >&2; exit 1; }
  done
}

# Every host namespace of ours, not only 0..P-1: a run killed with SIGKILL
# cannot clean up, and its P may have been larger.
down() {
  local ns
  for ns in $(ip netns list | awk '{print $1}' | grep -E "^${PREFIX}[0-9]+$"); do
    ip netns del "$ns" 2>/dev/null
  done
  ip link del "${PREFIX}br" 2>/dev/null
  return 0
}

# Held until this script exits; the kernel drops it even after SIGKILL.
hold_the_network() {
  command -v flock >/dev/null || return 0
  exec 9>"/run/onebit-shaped-net.lock" || return 0
  flock -n 9 || {
    echo "shaped_net.sh: another shaped_net.sh holds the network; wait for it to end" >&2
    exit 1
  }
}

up() {
  local rate=$1 i
  down
  ip link add "${PREFIX}br" type bridge && ip link set "${PREFIX}br" up || return 1
  for i in $(seq 0 $((P - 1))); do
    ip netns add "$PREFIX$i" &&
      ip link add "${PREFIX}v$i" type veth peer name "${PREFIX}h$i" &&
      ip link set "${PREFIX}v$i" netns "$PREFIX$i" &&
      ip link set "${PREFIX}h$i" master "${PREFIX}br" && ip link set "${PREFIX}h$i" up &&
      ip -n "$PREFIX$i" addr add "10.201.0.$((i + 1))/24" dev "${PREFIX}v$i" &&
      ip -n "$PREFIX$i" link set "${PREFIX}v$i" up && ip -n "$PREFIX$i" link set lo up || return 1
    if [ "$rate" != none ]; then
      # burst and latency sized for rates from 10 Mbit/s to 10 Gbit/s.
      ip netns exec "$PREFIX$i" tc qdisc add dev "${PREFIX}v$i" root tbf rate "$rate" \
        burst 1mbit latency 100ms || return 1
    fi
  done
}

[ $# -ge 2 ] || usage
act=$1 P=$2
case $P in '' | *[!0-9]* | 0) echo "shaped_net.sh: P must be a positive number of hosts" >&2; exit 2 ;; esac
[ "$P" -le 250 ] || { echo "shaped_net.sh: at most 250 hosts (one /24)" >&2; exit 2; }

case $act in
  up)
    [ $# -eq 3 ] || usage
    need_root_and_tools
    hold_the_network
    up "$3" || { down; echo "shaped_net.sh: could not build the network" >&2; exit 1; } ;;
  down)
    need_root_and_tools
    hold_the_network
    down ;;
  run)
    [ $# -ge 5 ] && [ "$4" = -- ] || usage
    rate=$3
    shift 4
    need_root_and_tools
    hold_the_network
    K=${PER_HOST:-1}
    case $K in '' | *[!0-9]* | 0) echo "shaped_net.sh: PER_HOST must be a positive number" >&2; exit 2 ;; esac
    pids=()
    # Whatever ends this script (the ranks finishing, Ctrl-C, kill), the ranks
    # stop and the namespaces go: a leftover bridge would shape the next run.
    cleanup() {
      trap - EXIT INT TERM
      # Every background job, not only "${pids[@]}": a signal can land between
      # starting a rank and recording its pid, and `wait` would then wait for
      # that rank to end by itself.
      local ranks
      ranks=$(jobs -p)
      [ -z "$ranks" ] || kill $ranks 2>/dev/null
      wait 2>/dev/null
      down
    }
    trap cleanup EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
    up "$rate" || { echo "shaped_net.sh: could not build the network" >&2; exit 1; }
    port=$((20000 + RANDOM % 20000))
    for i in $(seq 0 $((P - 1))); do
      for l in $(seq 0 $((K - 1))); do
        ip netns exec "$PREFIX$i" env RANK=$((i * K + l)) WORLD_SIZE=$((P * K)) \
          LOCAL_RANK=$l LOCAL_WORLD_SIZE=$K MASTER_ADDR=10.201.0.1 MASTER_PORT=$port \
          GLOO_SOCKET_IFNAME="${PREFIX}v$i" "$@" 9>&- &
        pids+=($!)
      done
    done
    rc=0
    for p in "${pids[@]}"; do
      wait "$p"
      status=$?
      [ $rc -ne 0 ] || rc=$status
    done
    exit $rc ;;
  *) usage ;;
esac
