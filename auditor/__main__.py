"""`python -m auditor` runs the `auditor` command."""

from auditor.cli import main

if __name__ == "__main__":
    main(prog_name="auditor")
