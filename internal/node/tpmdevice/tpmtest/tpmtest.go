// Package tpmtest runs real swtpm processes for tests (R9): a TPM 2.0 on a
// TCP command port, provisioned by swtpm_setup with an RSA-2048 and a P-384
// endorsement key whose certificates a local CA signed. Without swtpm a test
// skips, except under CI=true, where it fails.
package tpmtest

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/checks/tools"

	"github.com/better-compute/better-compute/internal/node/tpmdevice"
)

// Require skips t when swtpm or swtpm_setup is missing, and fails it under
// CI=true (CI installs them).
func Require(t testing.TB) {
	t.Helper()
	for _, bin := range []string{"swtpm", "swtpm_setup", "swtpm_localca"} {
		tools.Need(t, bin, "the TPM tests' software TPM: install swtpm and swtpm-tools")
	}
}

// Sim is a running swtpm.
type Sim struct {
	// Addr is the command port, 127.0.0.1:port (it changes on Restart).
	Addr string
	// Dir holds the TPM state.
	Dir string
	// CAFiles are the PEM files of the local CA that signed the EK
	// certificates (the issuer and its root): a manufacturer CA.
	CAFiles []string

	cmd  *exec.Cmd
	done chan struct{}
}

// Start runs an swtpm with its own copy of a provisioned state. Every Sim
// from Start is a copy of the same TPM (same EKs, same AK, one local CA);
// use StartFresh for a different TPM.
func Start(t testing.TB) *Sim {
	t.Helper()
	Require(t)
	tmpl, err := template()
	if err != nil {
		t.Fatalf("provision the swtpm template: %v", err)
	}
	dir := t.TempDir()
	if err := copyDir(filepath.Join(tmpl, "state"), filepath.Join(dir, "state")); err != nil {
		t.Fatal(err)
	}
	return run(t, dir, caFiles(filepath.Join(tmpl, "ca")))
}

// StartFresh runs an swtpm provisioned on its own: other EKs, another AK,
// certificates from another local CA.
func StartFresh(t testing.TB) *Sim {
	t.Helper()
	Require(t)
	dir := t.TempDir()
	if err := provision(dir); err != nil {
		t.Fatalf("provision swtpm: %v", err)
	}
	return run(t, dir, caFiles(filepath.Join(dir, "ca")))
}

// Open connects to the simulator; the connection closes at the test's end.
func (s *Sim) Open(t testing.TB) *tpmdevice.TPM {
	t.Helper()
	tp, err := tpmdevice.OpenSimulator(s.Addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tp.Close() })
	return tp
}

// Restart stops swtpm and starts it again on the same state, like a reboot
// of the machine's TPM: transient objects are gone, the seeds stay.
func (s *Sim) Restart(t testing.TB) {
	t.Helper()
	s.stop()
	ns := run(t, s.Dir, s.CAFiles)
	s.Addr, s.cmd, s.done = ns.Addr, ns.cmd, ns.done
}

// TCTI is the TSS's name for this simulator, for tools built on tpm2-tss
// (TPM2OPENSSL_TCTI, TPM2TOOLS_TCTI).
func (s *Sim) TCTI() string {
	host, port, _ := net.SplitHostPort(s.Addr)
	return "swtpm:host=" + host + ",port=" + port
}

// Stop stops swtpm (a TPM that is gone).
func (s *Sim) Stop() { s.stop() }

func (s *Sim) stop() {
	if s.cmd == nil {
		return
	}
	_ = s.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-s.done:
	case <-time.After(10 * time.Second):
		_ = s.cmd.Process.Kill()
		<-s.done
	}
	s.cmd = nil
}

func caFiles(caDir string) []string {
	return []string{filepath.Join(caDir, "issuercert.pem"), filepath.Join(caDir, "swtpm-localca-rootca-cert.pem")}
}

// run starts swtpm on dir's state. The command port is a free port picked
// by the kernel; swtpm binds it itself, so another process may take it in
// between: swtpm then exits before writing its pid file and run tries
// another port.
func run(t testing.TB, dir string, cas []string) *Sim {
	t.Helper()
	var lastErr error
	for range 10 {
		s, err := runOnce(dir, cas)
		if err == nil {
			t.Cleanup(s.stop)
			return s
		}
		lastErr = err
	}
	t.Fatalf("start swtpm: %v", lastErr)
	return nil
}

func runOnce(dir string, cas []string) (*Sim, error) {
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	pidFile := filepath.Join(dir, "swtpm.pid")
	_ = os.Remove(pidFile)
	cmd := exec.Command("swtpm", "socket", "--tpm2",
		"--tpmstate", "dir="+filepath.Join(dir, "state"),
		"--server", "type=tcp,bindaddr=127.0.0.1,port="+strconv.Itoa(port),
		// The control channel on the next port, where the TSS's swtpm
		// TCTI (tpm2-openssl, tpm2-tools) looks for it: Sim.TCTI.
		"--ctrl", "type=tcp,bindaddr=127.0.0.1,port="+strconv.Itoa(port+1),
		"--flags", "not-need-init,startup-clear",
		"--pid", "file="+pidFile)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("run swtpm: %w", err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	deadline := time.Now().Add(30 * time.Second)
	for {
		select {
		case <-done:
			return nil, fmt.Errorf("swtpm exited: %s", strings.TrimSpace(stderr.String()))
		default:
		}
		if b, err := os.ReadFile(pidFile); err == nil && strings.TrimSpace(string(b)) == strconv.Itoa(cmd.Process.Pid) {
			return &Sim{Addr: net.JoinHostPort("127.0.0.1", strconv.Itoa(port)), Dir: dir, CAFiles: cas, cmd: cmd, done: done}, nil
		}
		if time.Now().After(deadline) {
			_ = cmd.Process.Kill()
			<-done
			return nil, errors.New("swtpm did not start in 30s")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// provision runs swtpm_setup into dir/state with a local CA in dir/ca:
// an RSA-2048 EK (0x81010001) and a P-384 EK (0x81010016), each with a
// certificate in NV.
func provision(dir string) error {
	state, ca := filepath.Join(dir, "state"), filepath.Join(dir, "ca")
	for _, d := range []string{state, ca} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return err
		}
	}
	localca := filepath.Join(dir, "localca.conf")
	if err := os.WriteFile(localca, fmt.Appendf(nil, "statedir = %[1]s\nsigningkey = %[1]s/signkey.pem\nissuercert = %[1]s/issuercert.pem\ncertserial = %[1]s/certserial\n", ca), 0o600); err != nil {
		return err
	}
	opts := filepath.Join(dir, "localca.options")
	if err := os.WriteFile(opts, []byte("--platform-manufacturer better-compute\n--platform-version 2.1\n--platform-model test\n"), 0o600); err != nil {
		return err
	}
	setup := filepath.Join(dir, "setup.conf")
	if err := os.WriteFile(setup, fmt.Appendf(nil, "create_certs_tool = swtpm_localca\ncreate_certs_tool_config = %s\ncreate_certs_tool_options = %s\nactive_pcr_banks = sha256\n", localca, opts), 0o600); err != nil {
		return err
	}
	out, err := exec.Command("swtpm_setup", "--tpm2", "--tpmstate", state, "--config", setup,
		"--createek", "--ecc", "--create-ek-cert", "--create-platform-cert", "--overwrite").CombinedOutput()
	if err != nil {
		return fmt.Errorf("swtpm_setup: %v: %s", err, out)
	}
	return nil
}

var (
	templateOnce sync.Once
	templateDir  string
	templateErr  error
)

// template returns a provisioned state and CA, made once per machine and
// swtpm version under the user cache directory (swtpm_setup takes seconds).
func template() (string, error) {
	templateOnce.Do(func() {
		ver, err := exec.Command("swtpm", "--version").Output()
		if err != nil {
			templateErr = err
			return
		}
		base, err := os.UserCacheDir()
		if err != nil {
			base = os.TempDir()
		}
		sum := sha256.Sum256(ver)
		dir := filepath.Join(base, "better-compute", "swtpm-template-"+hex.EncodeToString(sum[:6]))
		if _, err := os.Stat(filepath.Join(dir, "state", "tpm2-00.permall")); err == nil {
			templateDir = dir
			return
		}
		if err := os.MkdirAll(filepath.Dir(dir), 0o700); err != nil {
			templateErr = err
			return
		}
		tmp, err := os.MkdirTemp(filepath.Dir(dir), ".swtpm-template-")
		if err != nil {
			templateErr = err
			return
		}
		if err := provision(tmp); err != nil {
			_ = os.RemoveAll(tmp)
			templateErr = err
			return
		}
		// Another test binary may have won the race: keep its template.
		if err := os.Rename(tmp, dir); err != nil {
			_ = os.RemoveAll(tmp)
			if _, serr := os.Stat(filepath.Join(dir, "state", "tpm2-00.permall")); serr != nil {
				templateErr = err
				return
			}
		}
		templateDir = dir
	})
	return templateDir, templateErr
}

func copyDir(from, to string) error {
	if err := os.MkdirAll(to, 0o700); err != nil {
		return err
	}
	entries, err := os.ReadDir(from)
	if err != nil {
		return err
	}
	for _, e := range entries {
		if !e.Type().IsRegular() || strings.HasSuffix(e.Name(), ".lock") {
			continue
		}
		b, err := os.ReadFile(filepath.Join(from, e.Name()))
		if err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(to, e.Name()), b, 0o600); err != nil {
			return err
		}
	}
	return nil
}
