"""`python -m numaudit.auditor` runs the `auditor` command."""

from numaudit.auditor.cli import main

if __name__ == "__main__":
    main(prog_name="auditor")
