# Sourced by the real-size scripts: `timed NAME COMMAND...` runs the command with its output in
# $out/NAME.log and GNU time's report (wall time, peak resident set) in $out/NAME.time, and stops the
# script, showing the log's end, when it fails.
timed() {
  local name=$1
  shift
  echo "== $name: $(date -u +%T) $*"
  /usr/bin/time -v -o "$out/$name.time" "$@" >"$out/$name.log" 2>&1 || {
    tail -n 30 "$out/$name.log"
    echo "$(basename "$0"): $name failed" >&2
    exit 1
  }
}
