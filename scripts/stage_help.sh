# Sourced by the wrappers of scripts/pretrain_dpo.sh (pretrain_sft.sh, train_reward_model.sh,
# iterative_dpo.sh): their --help, one copy.
#
# stage_help SCRIPT NOTE ARGS...: with -h / --help among ARGS, print SCRIPT's header comment (from
# its second line to the first line that is not a comment), the options it shares with
# pretrain_dpo.sh and NOTE (what is particular to it), then exit 0; else return.
stage_help() {
  local script="$1" note="$2" a
  shift 2
  for a in "$@"; do
    if [[ "$a" == "-h" || "$a" == "--help" ]]; then
      awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$script"
      echo
      echo "Options as for scripts/pretrain_dpo.sh (--config anywhere, key=value overrides,"
      echo "--list-keys, --print-config); $note"
      exit 0
    fi
  done
}
