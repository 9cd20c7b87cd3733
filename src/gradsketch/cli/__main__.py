"""``python -m gradsketch.cli``: the same commands as the ``gradsketch`` script."""

from gradsketch.cli import main

main()
