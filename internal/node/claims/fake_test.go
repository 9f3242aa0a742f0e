package claims

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/better-compute/better-compute/internal/shared/fakemachine"
	"github.com/better-compute/better-compute/internal/shared/hwid"
)

// collectFake reads a fake machine back the way bcd join does.
func collectFake(t *testing.T, sys, proc string) (hwid.Claims, []string) {
	t.Helper()
	c, warnings, err := New(Config{SysfsRoot: sys, ProcfsRoot: proc, Hostname: hostname("fake-1")}).Collect()
	if err != nil {
		t.Fatalf("Collect: %v", err)
	}
	return c, warnings
}

// R4.3: a fake machine is read back exactly as written: bcd join claims
// what `bcd fake-machine` was told, in sysfs's own forms.
func TestWriteFakeRoundTrip(t *testing.T) {
	for _, tc := range []struct {
		name string
		m    fakemachine.Machine
		want hwid.Claims
	}{
		{"serial and uuid, one NIC",
			fakemachine.Machine{ProductUUID: "4c4c4544-0042-3510-8053-b7c04f5a3132", ProductSerial: "SN-7701", MACs: []string{"3C-EC-EF-01-02-03"}},
			hwid.Claims{ProductUUID: "4c4c4544-0042-3510-8053-b7c04f5a3132", ProductSerial: "SN-7701", MACs: []string{"3c:ec:ef:01:02:03"}, Hostname: "fake-1"}},
		{"every identifier, two NICs and two GPUs",
			fakemachine.Machine{ProductUUID: "4C4C4544-0042-3510-8053-B7C04F5A3132", ProductSerial: "SN-7701", BoardSerial: "BRD-1", ChassisSerial: "CH-1",
				MACs: []string{"3c:ec:ef:01:02:04", "3c:ec:ef:01:02:03"}, GPUUUIDs: []string{"GPU-8f0c1d2e-aaaa-bbbb-cccc-ddddeeeeffff", "GPU-11111111-2222-3333-4444-555555555555"}},
			hwid.Claims{ProductUUID: "4C4C4544-0042-3510-8053-B7C04F5A3132", ProductSerial: "SN-7701", BoardSerial: "BRD-1", ChassisSerial: "CH-1",
				MACs: []string{"3c:ec:ef:01:02:03", "3c:ec:ef:01:02:04"}, GPUUUIDs: []string{"GPU-11111111-2222-3333-4444-555555555555", "GPU-8f0c1d2e-aaaa-bbbb-cccc-ddddeeeeffff"}, Hostname: "fake-1"}},
		// R6.1: placeholders are written as firmware reports them; hwid
		// drops them, not the fake machine.
		{"placeholder firmware",
			fakemachine.Machine{ProductUUID: "03000200-0400-0500-0006-000700080009", ProductSerial: "To Be Filled By O.E.M.", BoardSerial: "Default string", MACs: []string{"3c:ec:ef:01:02:03"}},
			hwid.Claims{ProductUUID: "03000200-0400-0500-0006-000700080009", ProductSerial: "To Be Filled By O.E.M.", BoardSerial: "Default string", MACs: []string{"3c:ec:ef:01:02:03"}, Hostname: "fake-1"}},
		// A locally administered MAC is written, and not claimed: claims
		// reads it as it reads a real one.
		{"a locally administered MAC is not claimed",
			fakemachine.Machine{ProductUUID: "4c4c4544-0042-3510-8053-b7c04f5a3132", ProductSerial: "SN-1", MACs: []string{"02:42:ac:11:00:02"}},
			hwid.Claims{ProductUUID: "4c4c4544-0042-3510-8053-b7c04f5a3132", ProductSerial: "SN-1", Hostname: "fake-1"}},
		{"no NIC", fakemachine.Machine{ProductSerial: "SN-2"}, hwid.Claims{ProductSerial: "SN-2", Hostname: "fake-1"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			sys, proc := filepath.Join(dir, "sys"), filepath.Join(dir, "proc")
			if err := fakemachine.Write(sys, proc, tc.m); err != nil {
				t.Fatal(err)
			}
			got, warnings := collectFake(t, sys, proc)
			if diff := cmp.Diff(tc.want, got, cmp.Comparer(func(a, b []string) bool { return cmp.Equal(nilIfEmpty(a), nilIfEmpty(b)) })); diff != "" {
				t.Errorf("claims (-want +got):\n%s", diff)
			}
			if len(warnings) != 0 {
				t.Errorf("warnings: %q", warnings)
			}
			if _, err := os.Stat(filepath.Join(sys, fakemachine.Marker)); err != nil {
				t.Errorf("no marker: %v", err)
			}
		})
	}
}

func nilIfEmpty(s []string) []string {
	if len(s) == 0 {
		return nil
	}
	return s
}

// R6.3: writing again over a fake machine replaces it: a swapped NIC is
// the only NIC left, and the GPU tree follows.
func TestWriteFakeReplaces(t *testing.T) {
	dir := t.TempDir()
	sys, proc := filepath.Join(dir, "sys"), filepath.Join(dir, "proc")
	m := fakemachine.Machine{ProductUUID: "4c4c4544-0042-3510-8053-b7c04f5a3132", ProductSerial: "SN-7701",
		MACs: []string{"3c:ec:ef:01:02:03", "3c:ec:ef:01:02:04"}, GPUUUIDs: []string{"GPU-aaaa"}}
	if err := fakemachine.Write(sys, proc, m); err != nil {
		t.Fatal(err)
	}
	m.MACs, m.GPUUUIDs = []string{"3c:ec:ef:09:09:09"}, []string{"GPU-bbbb"}
	if err := fakemachine.Write(sys, proc, m); err != nil {
		t.Fatal(err)
	}
	got, _ := collectFake(t, sys, proc)
	if !cmp.Equal(got.MACs, []string{"3c:ec:ef:09:09:09"}) || !cmp.Equal(got.GPUUUIDs, []string{"GPU-bbbb"}) {
		t.Fatalf("after the swap: %+v", got)
	}
}
