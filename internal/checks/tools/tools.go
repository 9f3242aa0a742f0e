// Package tools is the tests' one way to need a program that is not Go
// (openssl, swtpm, busybox, chromium, git...). Where it is missing, a test
// skips loudly on a developer's machine and fails in CI (CI=true, as
// .ci/run runs): CI installs every tool a test needs, so a skip there
// would be a test that silently stopped running.
//
// Only tests import it.
package tools

import (
	"os"
	"os/exec"
	"testing"
)

// InCI reports whether this is a CI run (CI=true): the one spelling the
// tests use.
func InCI() bool { return os.Getenv("CI") == "true" }

// Need returns the path of the program name; when it is missing it fails t
// in CI and skips it elsewhere, saying why the test needs it.
func Need(t testing.TB, name, why string) string {
	t.Helper()
	p, ok := Want(t, name, why)
	if !ok {
		t.Skipf("SKIPPING: %s is not installed (%s)", name, why)
	}
	return p
}

// Want is Need for a program only part of a test needs: when it is
// missing it fails t in CI, and elsewhere logs that this part is skipped
// and reports false.
func Want(t testing.TB, name, why string) (string, bool) {
	t.Helper()
	p, err := exec.LookPath(name)
	if err == nil {
		return p, true
	}
	Missing(t, name+" is not installed", why)
	t.Logf("SKIPPING what needs %s: it is not installed (%s)", name, why)
	return "", false
}

// Missing fails t in CI for a missing tool the test looked for in its own
// way (a provider module, one of several names), and returns elsewhere so
// the caller skips. what says what is missing, why what needs it.
func Missing(t testing.TB, what, why string) {
	t.Helper()
	if InCI() {
		t.Fatalf("%s (%s): CI=true, and CI installs it (.ci/run)", what, why)
	}
}
