#!/usr/bin/env bash
# CI only (.ci/run): list this host's TCPStore peer forms in /etc/hosts, as docs/vllm-plugin.md
# ("Reverse DNS") tells operators to. torch looks up every TCPStore peer's name; one not listed goes
# to the DNS server, and a reply it loses stalls that connection 5 s (1-8 % of lookups on the
# 2-core box): random 5 s waits in the suite's vLLM scales. Adds only missing lines; as root only.
set -euo pipefail
[ "$(id -u)" = 0 ] && [ -w /etc/hosts ] || exit 0
name=$(hostname 2>/dev/null || echo localhost)
listed() { awk -v a="$1" '$1 == a { found = 1 } END { exit !found }' /etc/hosts; }
for a in 127.0.0.1 $(hostname -I 2>/dev/null || true); do
  case $a in *:*) forms=$a ;; *) forms="$a ::ffff:$a" ;; esac  # a dual-stack listener sees ::ffff:a.b.c.d
  for f in $forms; do
    listed "$f" || { echo "$f $name" >> /etc/hosts && echo "ci_hosts: listed $f in /etc/hosts"; }
  done
done
