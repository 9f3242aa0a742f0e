package e2e

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/checks/doctest"
	"github.com/better-compute/better-compute/internal/checks/poll"
	"github.com/better-compute/better-compute/internal/checks/tools"
)

// TestProductionInstall runs the operator docs' production install as
// written, as root, each part in a fresh root (testdata/freshroot/enter:
// mount, network and PID namespaces where /etc, /usr, /var/lib and /run
// are throwaway overlays, so /etc/better-compute and
// /var/lib/better-compute are the real paths and the doc's ports are free):
// the "First install" section, compared with the output the doc shows,
// and the "Running under systemd" section, from a checkout with bin/
// built. systemd is not PID 1 here: a stand-in systemctl checks the
// installed units with systemd-analyze verify and starts what their
// ExecStart says, as their users, with their credentials and environment
// file. The sections are found by heading in docs/, whatever file they
// are in.
func TestProductionInstall(t *testing.T) {
	if os.Geteuid() != 0 {
		tools.Missing(t, "not root", "the production install runs as root in a mount namespace")
		t.Skip("SKIPPING: not root (the production install runs as root in a mount namespace)")
	}
	for _, tool := range []string{"unshare", "setpriv", "ip", "runuser", "systemd-sysusers", "curl", "jq"} {
		tools.Need(t, tool, "the production install in a fresh root")
	}
	_, verify := tools.Want(t, "systemd-analyze", "systemd-analyze verify of the installed units")
	bc, bcd := binaries(t)

	t.Run("first install", func(t *testing.T) {
		blocks := docSection(t, "First install")
		sh := freshRoot(t, t.TempDir(), filepath.Dir(bc), verify)
		runSection(t, sh, blocks)
	})

	t.Run("systemd", func(t *testing.T) {
		blocks := docSection(t, "Running under systemd")
		// A checkout with the binaries built: the doc installs bin/ and
		// deploy/systemd's files from it.
		work := t.TempDir()
		must(t, os.MkdirAll(filepath.Join(work, "bin"), 0o755))
		for _, b := range []string{bc, bcd} {
			data, err := os.ReadFile(b)
			must(t, err)
			must(t, os.WriteFile(filepath.Join(work, "bin", filepath.Base(b)), data, 0o755))
		}
		must(t, os.MkdirAll(filepath.Join(work, "deploy"), 0o755))
		must(t, os.CopyFS(filepath.Join(work, "deploy", "systemd"), os.DirFS("../deploy/systemd")))
		sh := freshRoot(t, work, "", verify)
		// The names the doc uses, as the operator's DNS would give them.
		res := runIn(t, sh, "echo '127.0.0.1 api.internal compute.example.com gw.eu.example.com' >> /etc/hosts")
		res = append(res, runSection(t, sh, blocks)...)
		export := ""
		for _, r := range res {
			for _, l := range strings.Split(r.Output(), "\n") {
				if strings.HasPrefix(l, "export BETTER_COMPUTE_API_KEY=") {
					export = l
				}
			}
		}
		if export == "" {
			t.Fatal("bootstrap printed no admin key")
		}
		// The API the unit started, as its user, answers over TLS from the
		// serving CA.
		waitLog(t, sh, "better-compute", `msg="API listening"`)
		runIn(t, sh, export, "better-compute tenants get $TENANT --url https://compute.example.com:8443 --ca-file /var/lib/better-compute/pki/serving-ca.crt")
		// The gateway, a transient user with its certificate as a
		// credential, answers TLS on :443 with the certificate issued for
		// it.
		waitLog(t, sh, "better-compute-gateway", `msg="gateway listening"`)
		runIn(t, sh, "curl -sS -o /dev/null --cacert /etc/better-compute/serving-ca.crt https://gw.eu.example.com/")
		// A machine joins through them: bcd reads the well-known document
		// from the API (its certificate from the serving CA, trusted
		// through the pins alone), then joins through the gateway the
		// document names, which relays to the API's agent listener.
		sys := filepath.Join(work, "sys")
		fakeSysfs(t, sys, "SN-7300", "00112233-4455-6677-8899-aabbccdd7300", "3c:ec:ef:0a:73:00")
		res = runIn(t, sh, export, "export BETTER_COMPUTE_URL=https://compute.example.com:8443 BETTER_COMPUTE_CA_FILE=/var/lib/better-compute/pki/serving-ca.crt",
			"site=$(better-compute sites create eu-1 --tenant $TENANT --region eu --json | jq -r .id)",
			"pool=$(better-compute pools create gpu --tenant $TENANT --site $site --json | jq -r .id)",
			"pins=$(better-compute pki pins --dir /var/lib/better-compute/pki --json)",
			"better-compute join-tokens create --tenant $TENANT --pool $pool --ttl 1h --out /run/join-token",
			"bin/bcd join --server https://compute.example.com:8443 --site $site --serving-ca-pin $(jq -r .servingCaPin <<<\"$pins\") "+
				"--join-signing-pin $(jq -r .joinSigningKeyPin <<<\"$pins\") --join-encryption-pin $(jq -r .joinEncryptionKeyPin <<<\"$pins\") "+
				"--token-file /run/join-token --config /etc/bcd/config.toml --data-dir /var/lib/bcd --sysfs-root "+sys)
		if out := res[len(res)-1].Output(); !strings.Contains(out, "joined as node_") {
			t.Fatalf("bcd join through the gateway:\n%s", out)
		}
	})
}

// docSection returns the sh blocks under heading in docs/ (skipped ones
// too: this test is what runs them).
func docSection(t *testing.T, heading string) []doctest.Block {
	t.Helper()
	files, _ := filepath.Glob("../docs/*.md")
	more, _ := filepath.Glob("../docs/*/*.md")
	for _, f := range append(files, more...) {
		rel := strings.TrimPrefix(f, "../")
		md := readDoc(t, rel)
		blocks, err := doctest.ParseWalkthroughs(rel, md)
		if err != nil {
			t.Fatal(err)
		}
		if s, ok := doctest.Section(md, blocks, heading); ok {
			if len(s) == 0 {
				t.Fatalf("%s: %q has no sh block", rel, heading)
			}
			return s
		}
	}
	t.Fatalf("no doc under docs/ has a section %q", heading)
	return nil
}

// freshRoot starts a shell in dir inside a fresh root; bin, when set, is
// put on PATH (the reader's installed binaries).
func freshRoot(t *testing.T, dir, bin string, verify bool) *doctest.Shell {
	t.Helper()
	fake, err := filepath.Abs("testdata/freshroot")
	must(t, err)
	path := fake + ":/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
	if bin != "" {
		path = bin + ":" + path
	}
	env := []string{"HOME=" + dir, "PATH=" + path, "BETTER_COMPUTE_URL=", "BETTER_COMPUTE_API_KEY=", "BETTER_COMPUTE_CA_FILE=", "BETTER_COMPUTE_SECRET="}
	if verify {
		env = append(env, "BC_VERIFY_UNITS=1")
	}
	sh, err := doctest.NewShellIn(dir, env, "unshare", "--mount", "--net", "--pid", "--fork", "--kill-child", "--mount-proc",
		filepath.Join(fake, "enter"), t.TempDir())
	must(t, err)
	t.Cleanup(func() { sh.Close(15 * time.Second) })
	return sh
}

// runSection runs blocks in order: a block the doc shows output for is
// compared with it, any other must have every command succeed.
func runSection(t *testing.T, sh *doctest.Shell, blocks []doctest.Block) []doctest.Result {
	t.Helper()
	norm := doctest.Normaliser{}
	var all []doctest.Result
	for _, b := range blocks {
		res, err := sh.Run(b, 3*time.Minute)
		must(t, err)
		all = append(all, res...)
		if b.Output != nil && b.Skip == "" {
			checkBlock(t, norm, b, res)
			continue
		}
		for _, r := range res {
			if !r.Background && r.Code != 0 {
				t.Fatalf("%s: %q exited %d:\n%s", b.Where(), r.Command, r.Code, r.Output())
			}
		}
	}
	return all
}

// runIn runs the test's own commands in the shell; each must succeed.
func runIn(t *testing.T, sh *doctest.Shell, cmds ...string) []doctest.Result {
	t.Helper()
	res, err := sh.Run(doctest.Block{File: "test", Text: strings.Join(cmds, "\n")}, 2*time.Minute)
	must(t, err)
	for _, r := range res {
		if r.Code != 0 {
			t.Fatalf("%q exited %d:\n%s", r.Command, r.Code, r.Output())
		}
	}
	return res
}

// waitLog waits until what systemd would have logged for unit shows want.
func waitLog(t *testing.T, sh *doctest.Shell, unit, want string) {
	t.Helper()
	var out string
	if !poll.WaitEvery(60*time.Second, 500*time.Millisecond, func() bool {
		res, err := sh.Run(doctest.Block{File: "test", Text: "journalctl -u " + unit}, time.Minute)
		must(t, err)
		out = doctest.Combined(res)
		return strings.Contains(out, want)
	}) {
		t.Fatalf("%s never logged %s:\n%s", unit, want, out)
	}
}
