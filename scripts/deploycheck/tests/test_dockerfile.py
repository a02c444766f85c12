"""dockerfile.py: the image's stages, user, health check and port; .dockerignore."""

import importlib.util
import unittest

from deploycheck import dockerfile
from deploycheck.tests.support import TreeCase

DOCKERFILE = """\
# syntax=docker/dockerfile:1
FROM swift:6.0 AS build
RUN swift build -c release --static-swift-stdlib \\
      --product presence-gateway
FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y libhiredis0.14
COPY --from=build /b/presence-gateway /b/presencectl /usr/local/bin/
ENV PRESENCE_HOST=0.0.0.0
EXPOSE 8080
USER 10001:10001
HEALTHCHECK CMD curl -fsS http://127.0.0.1:8080/healthz
ENTRYPOINT ["presence-gateway"]
"""


class DockerfileTests(TreeCase):
    def check(self, text=DOCKERFILE):
        tree = self.tree({"deploy/Dockerfile": text})
        return tree, dockerfile.check_dockerfile(tree)

    def test_good_dockerfile_passes(self):
        tree, healthcheck = self.check()
        self.assertClean(tree)
        self.assertEqual(healthcheck, "CMD curl -fsS http://127.0.0.1:8080/healthz")
        self.assertEqual(self.linted[0][0], "hadolint")

    def test_root_user_fails(self):
        tree, _ = self.check(DOCKERFILE.replace("USER 10001:10001", "USER 0"))
        self.assertFails(tree, "the runtime stage must end with a numeric USER that is not 0 (found 0)")

    def test_no_healthcheck_fails_and_gives_compose_none(self):
        tree, healthcheck = self.check(DOCKERFILE.replace("HEALTHCHECK CMD", "HEALTHCHECK NONE\n# CMD"))
        self.assertFails(tree, "runtime stage needs a HEALTHCHECK on /healthz")
        self.assertIsNone(dockerfile.check_dockerfile(self.tree({"deploy/Dockerfile": "FROM x\n"})))
        self.assertIsNotNone(healthcheck)

    def test_other_port_and_single_stage_fail(self):
        text = DOCKERFILE.replace("EXPOSE 8080", "EXPOSE 9090").split("FROM debian", 1)[1]
        tree, _ = self.check("FROM debian" + text)
        self.assertFails(tree, "runtime stage must EXPOSE 8080 (found 9090)", "needs a build stage and a runtime stage",
                         "the build stage must use --static-swift-stdlib")

    def test_missing_dockerfile_fails(self):
        tree, _ = self.check(None)
        self.assertEqual(tree.report.lines, ["FAIL  deploy/Dockerfile: missing"])


@unittest.skipUnless(importlib.util.find_spec("docker"), "the Docker SDK for Python is not installed (.tools/venv has it)")
class DockerignoreTests(TreeCase):
    def check(self, text):
        tree = self.tree({".dockerignore": text})
        dockerfile.check_dockerignore(tree)
        return tree

    def test_good_dockerignore_passes(self):
        self.assertClean(self.check(".build\n.build-*\n.git\n# secrets\n.env\n"))

    def test_sent_secrets_and_dropped_sources_fail(self):
        tree = self.check(".build\n.build-*\n.git\nSources\n")
        self.assertFails(tree, "does not leave out .env", "leaves out Sources/presence-gateway/main.swift")


if __name__ == "__main__":
    unittest.main()
