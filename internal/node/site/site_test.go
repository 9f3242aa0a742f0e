package site

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// R10.4: the booted file keeps the newest boot per MAC, in canonical form;
// lines that do not parse or check are skipped and counted.
func TestBootedFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), BootedFile)
	if ms, skipped, err := Read(path); err != nil || len(ms) != 0 || skipped != 0 {
		t.Fatalf("a missing file: %v %d %v, want no machine", ms, skipped, err)
	}
	for _, m := range []Machine{
		{MAC: "00-1B-21-0A-0B-0C", IP: "10.0.0.7", LeaseEpoch: 2},
		{MAC: "00:1b:21:0a:0b:0c", IP: "10.0.0.9", LeaseEpoch: 1}, // older: ignored
		{MAC: "00:1b:21:0a:0b:0d", IP: "10.0.0.8", LeaseEpoch: 1, WorkflowID: "wf-7"},
	} {
		if err := Append(path, m); err != nil {
			t.Fatal(err)
		}
	}
	if err := Append(path, Machine{MAC: "52:54:00:00:00:01", IP: "10.0.0.1", LeaseEpoch: 1}); err == nil {
		t.Fatal("a locally administered MAC was recorded")
	}
	f, err := os.OpenFile(path, os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = f.WriteString("not json\n" + strings.Repeat("x", 2*MaxLine) + "\n")
	f.Close()
	if st, _ := os.Stat(path); st.Mode().Perm() != 0o600 {
		t.Errorf("booted file mode %v, want 0600", st.Mode().Perm())
	}
	ms, skipped, err := Read(path)
	if err != nil {
		t.Fatal(err)
	}
	if skipped != 2 || len(ms) != 2 || ms[0].MAC != "00:1b:21:0a:0b:0c" || ms[0].IP != "10.0.0.7" || ms[0].LeaseEpoch != 2 || ms[1].WorkflowID != "wf-7" {
		t.Fatalf("read %+v (%d skipped), want the newest boot of each MAC and 2 skipped lines", ms, skipped)
	}
}
