package grpcmsg

import (
	"bytes"
	"errors"
	"fmt"
	"testing"
)

// Messages come out whole wherever the stream is cut, every byte fed is
// either a message's window or held, and a message over Max is refused.
func TestMessagesCutAnywhere(t *testing.T) {
	var stream []byte
	want := [][]byte{{}, []byte("a"), bytes.Repeat([]byte("b"), 300), bytes.Repeat([]byte("c"), 70000)}
	for _, m := range want {
		stream = Append(stream, 0, m)
	}
	collect := func(chunks ...[]byte) ([][]byte, error) {
		m := Messages{Max: 70000}
		var got [][]byte
		for _, c := range chunks {
			windows := 0
			held, err := m.Feed(c, func(_ byte, msg []byte, window int) error {
				got = append(got, append([]byte{}, msg...))
				windows += window
				return nil
			})
			if err != nil {
				return got, err
			}
			if windows+held != len(c) {
				return got, fmt.Errorf("windows %d + held %d != %d bytes fed", windows, held, len(c))
			}
		}
		if m.Partial() {
			return got, errors.New("a partial message left")
		}
		return got, nil
	}
	check := func(name string, got [][]byte, err error) {
		t.Helper()
		if err != nil || len(got) != len(want) {
			t.Fatalf("%s: %d messages, %v", name, len(got), err)
		}
		for i := range want {
			if !bytes.Equal(got[i], want[i]) {
				t.Fatalf("%s: message %d differs", name, i)
			}
		}
	}
	for k := 0; k <= len(stream); k += 1 + k/50 {
		got, err := collect(stream[:k], stream[k:])
		check(fmt.Sprintf("cut at %d", k), got, err)
	}
	var bytewise [][]byte
	for i := range stream {
		bytewise = append(bytewise, stream[i:i+1])
	}
	got, err := collect(bytewise...)
	check("byte by byte", got, err)

	m := Messages{Max: 10}
	if _, err := m.Feed(Append(nil, 0, make([]byte, 11)), func(byte, []byte, int) error { return nil }); !errors.Is(err, ErrTooLarge) {
		t.Fatalf("11 bytes over a limit of 10: %v", err)
	}
}
