"""The report every check writes to: one line per check, ok, FAIL or skip, and the counts."""


class Report:
    def __init__(self, echo=True):
        # echo=False keeps the lines to itself, for the unit tests.
        self.passed = self.failed = self.skipped = 0
        self.lines = []
        self.echo = echo

    def _line(self, word, what):
        line = f"{word:<6}{what}"
        self.lines.append(line)
        if self.echo:
            print(line)

    def ok(self, what):
        self.passed += 1
        self._line("ok", what)

    def fail(self, what):
        self.failed += 1
        self._line("FAIL", what)

    def skip(self, what):
        self.skipped += 1
        self._line("skip", what)

    def check(self, condition, good, bad):
        """ok(good) if condition, else fail(bad). Returns condition."""
        (self.ok if condition else self.fail)(good if condition else bad)
        return bool(condition)

    def failures(self):
        return [line for line in self.lines if line.startswith("FAIL")]

    def summary(self):
        return f"check-deploy: {self.passed} passed, {self.failed} failed, {self.skipped} skipped"
