package doctor

import (
	"encoding/hex"
	"strings"
	"testing"

	"github.com/better-compute/better-compute/internal/node/tpmdevice/tpmtest"
	"github.com/better-compute/better-compute/internal/shared/bcdconfig"
	"github.com/better-compute/better-compute/internal/shared/tpmverify"
)

// R9.2: the TPM check prints the EK's ek_sha256, the very hex the server's
// EK allow-list takes for this TPM.
func TestTPMCheckPrintsEKHashR9_2(t *testing.T) {
	sim := tpmtest.Start(t)
	tpm := sim.Open(t)
	ek, err := tpm.DefaultEK()
	if err != nil {
		t.Fatal(err)
	}
	h, err := tpmverify.EKHash(&ek.Public)
	if err != nil {
		t.Fatal(err)
	}
	tpm.Close()
	c := tpmCheck(&bcdconfig.Config{TPM: bcdconfig.TPM{Simulator: sim.Addr, Mode: bcdconfig.TPMRequired}}, t.TempDir())
	if c.Status != OK || !strings.Contains(c.Detail, "ek_sha256 "+hex.EncodeToString(h)) {
		t.Errorf("tpm check %s: %s, want ek_sha256 %x", c.Status, c.Detail, h)
	}
}
