package ids

import (
	"sort"
	"testing"
	"time"
)

func TestNewIsValidAndSortable(t *testing.T) {
	base := time.Date(2026, 11, 29, 0, 0, 0, 0, time.UTC)
	var got []string
	for i := 0; i < 100; i++ {
		id := New(JoinToken, base.Add(time.Duration(i)*time.Millisecond))
		if !Valid(JoinToken, id) {
			t.Fatalf("invalid id %q", id)
		}
		got = append(got, id)
	}
	if !sort.StringsAreSorted(got) {
		t.Fatalf("ids not sorted by time: %v", got)
	}
}

func TestValid(t *testing.T) {
	good := New(Node, time.Now())
	for _, tc := range []struct {
		in   string
		want bool
	}{
		{good, true},
		{"jt_" + good[5:], false},
		{good + "x", false},
		{"node_01K5W0000000000000000000AA", false},
		{"node_", false},
		{"node_8zzzzzzzzzzzzzzzzzzzzzzzzz", false},
	} {
		if got := Valid(Node, tc.in); got != tc.want {
			t.Errorf("Valid(%q) = %v, want %v", tc.in, got, tc.want)
		}
	}
}
