#compdef eepctl

_eepctl_completion() {
  eval $(env _TYPER_COMPLETE_ARGS="${words[1,$CURRENT]}" _EEPCTL_COMPLETE=complete_zsh eepctl)
}

compdef _eepctl_completion eepctl
